"""rayexport.plan.megatron_cuts: each kind of Megatron-Bridge mapping as tiles of the tensor a
Megatron-Core torch_dist save holds. Each case lays Hugging Face tensors out as Megatron-Core
saves them (this test's own writing of that layout, from Megatron-Bridge's `hf_to_megatron` and
Megatron-Core's `sharded_state_dict`: query groups, [gate ; up], split pieces, a zero-centred
norm), then applies the tiles with plain indexing and must get each Hugging Face tensor back.
tests/test_megatron_bridge.py checks the same against Megatron-Bridge's own saves and exports."""

import pytest
import torch

from rayexport.common.errors import ExportError
from rayexport.plan.megatron_cuts import Cut, split_keys


def applied(tiles, sources, shape):
    """The target of `shape` the tiles make of `sources` (name: tensor), each tile's box of its
    source laid along the target's axes, scaled and shifted; every element set exactly once."""
    out = torch.full(shape, float("nan"))
    covered = torch.zeros(shape, dtype=torch.int64)
    for tile in tiles:
        source = sources[tile.source]
        box = source[tuple(
            slice(start, start + (extent - 1) * tile.step(axis) + 1, tile.step(axis))
            for axis, (start, extent) in enumerate(zip(tile.source_offset, tile.source_shape))
        )]
        kept = [axis for axis in tile.axes if axis is not None]
        box = box.permute(kept + [axis for axis in range(box.dim()) if axis not in kept]).reshape(tile.shape)
        region = tuple(
            slice(start, start + (size - 1) * tile.target_step(axis) + 1, tile.target_step(axis))
            for axis, (start, size) in enumerate(zip(tile.offset, tile.shape))
        )
        out[region] = box * tile.scale + tile.shift
        covered[region] += 1
    assert torch.equal(covered, torch.ones_like(covered))
    return out


def cut(kind, part, key, saved, index=(), tower=None, options=None, pieces=()):
    return Cut(kind, options or {}, part, key, tuple(saved.shape), index, tower or {}, pieces)


def group_rows(q, k, v, groups):
    """Megatron's linear_qkv rows: each query group's q rows, its k rows, its v rows."""
    return torch.cat([torch.cat([q.chunk(groups)[g], k.chunk(groups)[g], v.chunk(groups)[g]]) for g in range(groups)])


@pytest.mark.parametrize("heads,groups,head_dim,v_dim", [(4, 2, 8, 8), (6, 3, 4, 4), (4, 4, 8, 8), (4, 2, 12, 8)])
def test_q_k_and_v_come_from_their_rows_of_each_query_group(heads, groups, head_dim, v_dim):
    """GQA, MHA, and v heads smaller than q and k ones (MiMo-V2-Flash), with a layer axis."""
    q, k, v = torch.randn(heads * head_dim, 16), torch.randn(groups * head_dim, 16), torch.randn(groups * v_dim, 16)
    saved = torch.stack([torch.randn_like(group_rows(q, k, v, groups)), group_rows(q, k, v, groups)])  # layer 1
    parts = {"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape)}
    tower = {"num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": head_dim}
    for part, tensor in zip("qkv", (q, k, v)):
        tiles = cut("qkv", part, "linear_qkv", saved, (1,), tower).tiles("x", tuple(tensor.shape), parts)
        assert torch.equal(applied(tiles, {"linear_qkv": saved}, tensor.shape), tensor), part


def test_a_gated_attentions_q_rows_interleave_each_heads_query_and_gate():
    """Qwen3-Next's, Qwen3.5's: Hugging Face's q_proj holds per head [q ; gate]; a saved query
    group holds its heads' q rows, then their gate rows, then k and v."""
    heads, groups, dim = 4, 2, 8
    per_head = torch.randn(heads, 2, dim, 16)
    q_proj = per_head.reshape(heads * 2 * dim, 16)
    k, v = torch.randn(groups * dim, 16), torch.randn(groups * dim, 16)
    grouped_heads = per_head.reshape(groups, heads // groups, 2, dim, 16)
    saved = torch.cat([
        torch.cat([grouped_heads[g, :, 0].reshape(-1, 16), grouped_heads[g, :, 1].reshape(-1, 16), k.chunk(groups)[g], v.chunk(groups)[g]])
        for g in range(groups)
    ])
    parts = {"q": tuple(q_proj.shape), "k": tuple(k.shape), "v": tuple(v.shape)}
    tower = {"num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": dim}
    for part, tensor in (("q", q_proj), ("k", k), ("v", v)):
        tiles = cut("qkv", part, "qkv", saved, tower=tower).tiles("x", tuple(tensor.shape), parts)
        assert torch.equal(applied(tiles, {"qkv": saved}, tensor.shape), tensor), part


def test_a_fused_qkv_is_every_q_then_every_k_then_every_v_row():
    heads, groups, dim = 4, 2, 8
    q, k, v = torch.randn(heads * dim), torch.randn(groups * dim), torch.randn(groups * dim)
    fused = torch.cat([q, k, v])
    tiles = cut("concatenated_qkv", "", "qkv", group_rows(q, k, v, groups),
                tower={"num_heads": heads, "num_key_value_heads": groups}).tiles("x", tuple(fused.shape), {})
    assert torch.equal(applied(tiles, {"qkv": group_rows(q, k, v, groups)}, fused.shape), fused)


def test_gate_and_up_are_the_halves_of_linear_fc1():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    saved = torch.cat([gate, up])[None].expand(3, -1, -1).clone()  # (layers, 2 * ffn, hidden)
    for part, tensor in (("gate", gate), ("up", up)):
        tiles = cut("gated_mlp", part, "fc1", saved, (2,)).tiles("x", (6, 4), {})
        assert torch.equal(applied(tiles, {"fc1": saved}, (6, 4)), tensor)


@pytest.mark.parametrize("transposed", [False, True])
def test_a_layers_experts_as_one_tensor_in_either_orientation(transposed):
    """(experts, out, in) as saved, or (experts, in, out) where only that fits and the row says
    `transpose_on_export` (Megatron-Bridge transposes just then)."""
    saved = torch.randn(2, 3, 10, 4)  # (layers, experts, 2 * ffn, hidden)
    expected = saved[1].transpose(1, 2) if transposed else saved[1]
    tiles = cut("fused_gated_experts", "", "fc1", saved, (1,), options={"transpose_on_export": True}).tiles(
        "x", tuple(expected.shape), {})
    assert torch.equal(applied(tiles, {"fc1": saved}, expected.shape), expected)


def test_a_zero_centred_norm_gets_its_one_back():
    saved = torch.randn(2, 8)
    tiles = cut("zero_centered_norm", "", "out_norm", saved, (1,)).tiles("x", (8,), {})
    assert torch.equal(applied(tiles, {"out_norm": saved}, (8,)), saved[1] + 1)


def test_zeros_stand_in_for_a_value_heads_missing_bias():
    head = torch.randn(2, 1, 8)  # (layers, one value row, hidden): the last layer's output layer
    head[1, 0, 0] = -3.0
    tiles = cut("zeros", "", "output_layer.weight", head, (1,)).tiles("score.bias", (1,), {})
    zeros = applied(tiles, {"output_layer.weight": head}, (1,))
    assert torch.equal(zeros, torch.zeros(1))


def test_qwen3_next_projections_take_each_key_heads_group_of_each_piece():
    """in_proj_qkvz holds, per key head, [q ; k ; v ; z]; Megatron-Core saves the projection as
    pieces, `.query` ... `.alpha`, each every key head's rows of one part."""
    key_heads, dk, dv = 2, 4, 6
    per_head = {name: torch.randn(key_heads, rows, 5) for name, rows in
                (("query", dk), ("key", dk), ("value", dv), ("z", dv), ("beta", 3), ("alpha", 3))}
    saved = {f"in_proj.{name}": tensor.reshape(-1, 5) for name, tensor in per_head.items()}
    tower = {"linear_num_key_heads": key_heads}
    for part, names in (("qkvz", ("query", "key", "value", "z")), ("ba", ("beta", "alpha"))):
        expected = torch.cat([torch.cat([per_head[name][g] for name in names]) for g in range(key_heads)])
        keys = split_keys("gdn_in_proj", part, "in_proj")
        pieces = tuple((key, tuple(saved[key].shape)) for key in keys)
        tiles = Cut("gdn_in_proj", {}, part, "in_proj", pieces[0][1], (), tower, pieces).tiles("x", tuple(expected.shape), {})
        assert torch.equal(applied(tiles, saved, expected.shape), expected), part


@pytest.mark.parametrize("kind,part,names", [
    ("gdn_in_proj_separate", "qkv", ("query", "key", "value")),
    ("gdn_conv1d", "", ("query", "key", "value")),
    ("mamba_in_proj", "", ("z", "x", "B", "C", "dt")),
    ("mamba_conv1d", "", ("x", "B", "C")),
])
def test_split_pieces_are_the_hugging_face_rows_one_after_the_other(kind, part, names):
    """Qwen3.5's in_proj_qkv and DeltaNet's conv1d, Mamba's in_proj and conv1d (a layer axis,
    a convolution's (channels, 1, kernel))."""
    saved = {f"p.{name}": torch.randn(2, 3 + position, 1, 4) for position, name in enumerate(names)}
    expected = torch.cat([saved[f"p.{name}"][1] for name in names])
    pieces = tuple((key, tuple(saved[key].shape)) for key in split_keys(kind, part, "p"))
    tiles = Cut(kind, {}, part, "p", pieces[0][1], (1,), {}, pieces).tiles("x", tuple(expected.shape), {})
    assert torch.equal(applied(tiles, saved, expected.shape), expected)


def test_gpt_oss_experts_interleave_gate_and_up_columns_and_transpose_down():
    """gpt-oss's `gate_up_proj` (experts, hidden, 2 * ffn) holds each expert's gate and up
    columns interleaved, gate first; `down_proj` (experts, ffn, hidden) each expert's linear_fc2
    transposed, though square (as gpt-oss's are); the biases as saved ([gate ; up] interleaved)."""
    experts, ffn, hidden = 3, 4, 4
    gate, up = torch.randn(experts, hidden, ffn), torch.randn(experts, hidden, ffn)
    gate_up = torch.stack([gate, up], dim=-1).reshape(experts, hidden, 2 * ffn)
    fc1 = torch.cat([gate, up], dim=-1).transpose(1, 2)  # (experts, [gate ; up], hidden)
    saved = torch.stack([torch.zeros_like(fc1), fc1])  # layer 1
    tiles = cut("gpt_oss_gate_up", "", "fc1", saved, (1,)).tiles("gate_up_proj", tuple(gate_up.shape), {})
    assert torch.equal(applied(tiles, {"fc1": saved}, gate_up.shape), gate_up)
    bias = torch.randn(experts, 2, ffn)  # [gate ; up] rows
    tiles = cut("gpt_oss_gate_up", "", "fc1.bias", bias.reshape(experts, 2 * ffn)).tiles("gate_up_proj_bias", (experts, 2 * ffn), {})
    assert torch.equal(applied(tiles, {"fc1.bias": bias.reshape(experts, 2 * ffn)}, (experts, 2 * ffn)),
                      bias.transpose(1, 2).reshape(experts, 2 * ffn))
    fc2 = torch.randn(experts, hidden, ffn)
    tiles = cut("gpt_oss_down", "", "fc2", fc2).tiles("down_proj", (experts, ffn, hidden), {})
    assert torch.equal(applied(tiles, {"fc2": fc2}, (experts, ffn, hidden)), fc2.transpose(1, 2))


def test_the_vocabulary_is_cut_from_its_padded_rows_and_unit_axes_are_added():
    padded = torch.randn(128, 8)
    tiles = cut("direct", "", "embedding.word_embeddings.weight", padded).tiles("x", (96, 8), {})
    assert torch.equal(applied(tiles, {"embedding.word_embeddings.weight": padded}, (96, 8)), padded[:96])
    bias = torch.randn(3, 5)  # ERNIE's expert bias, [N] saved, [1, N] on disk
    tiles = cut("direct", "", "bias", bias, (2,)).tiles("x", (1, 5), {})
    assert torch.equal(applied(tiles, {"bias": bias}, (1, 5)), bias[2][None])


def test_permuted_dims_follow_the_rows_permute_dims():
    saved = torch.randn(4, 6)
    tiles = cut("direct", "", "proj", saved, options={"permute_dims": [1, 0]}).tiles("x", (6, 4), {})
    assert torch.equal(applied(tiles, {"proj": saved}, (6, 4)), saved.T)


def test_a_shape_that_does_not_fit_a_layer_past_the_saved_ones_and_an_unknown_kind_are_one_line():
    saved = torch.randn(2, 24, 8)
    tower = {"num_attention_heads": 10, "num_key_value_heads": 5}  # the saved rows are 2 groups' or 3's
    with pytest.raises(ExportError, match=r"'linear_qkv' has shape \[2, 24, 8\], not 5 query groups of 2 q, 1 k and 1 v rows"):
        cut("qkv", "q", "linear_qkv", saved, (0,), tower).tiles("q_proj", (12, 8), {"q": (12, 8), "k": (6, 8), "v": (6, 8)})
    with pytest.raises(ExportError, match=r"'o_proj' needs layer 2 of Megatron-Core tensor 'linear_qkv', which holds 2"):
        cut("direct", "", "linear_qkv", saved, (2,)).tiles("o_proj", (24, 8), {})
    with pytest.raises(ExportError, match="through Megatron-Bridge's _HCAlphaMapping mapping, which rayexport does not apply yet"):
        cut("_HCAlphaMapping", "", "alpha", saved).tiles("hc_attn_scale", (3,), {})
