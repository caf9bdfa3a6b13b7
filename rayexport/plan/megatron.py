"""Megatron-Core's names for a Hugging Face model, and the tiles of them that each on-disk tensor
is: what each tensor of a `torch_dist` checkpoint becomes. Pure functions.

A Megatron-Core checkpoint stacks each layer's tensors on a leading axis
(`decoder.layers.self_attention.linear_qkv.weight` is (layers, rows, hidden); pipeline stages
save their layers' range of it), MoE experts on a second one (`...experts.experts.linear_fc1.weight`
is (layers, experts, 2 * ffn, hidden)), and fuses projections: `linear_qkv` rows come a query
group at a time, [the group's q heads, its k head, its v head], and `linear_fc1` rows are
[gate ; up] in the saved tensor (each tensor-parallel rank saves its two halves as two chunks).
Norms are saved under TransformerEngine's fused names even by the local layer spec
(`linear_qkv.layer_norm_weight`), or apart (`input_layernorm.weight`). Where the layers differ
(DeepSeek-V3's dense, then MoE ones) each is saved apart, `decoder.layers.<L>.X`, with no layer
axis. Multi-latent attention's projections (DeepSeek-V3) are saved unfused, one tensor each.
So each Hugging Face tensor is a box of one saved tensor: a layer (and expert) index, a block of
rows. A vision-language model (mbridge's Qwen2.5-VL) saves its language model's tensors under
`language_model.` and its vision tower's under `vision_model.`, whose `linear_qkv` rows come a
head at a time, [q ; k ; v], where Hugging Face's fused `qkv` is [all q ; all k ; all v].

The rules are written out here rather than by calling Megatron's or mbridge's conversions: those
import Megatron-Core, which needs a torch of its own and builds the whole model. tests/test_megatron.py
checks them tensor for tensor against mbridge's export of real Megatron-Core checkpoints.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

from rayexport.common.errors import ExportError
from rayexport.plan.formats import Naming, ProducerNaming
from rayexport.plan.tiles import Tile

PRODUCER = "megatron"
Saved = dict[str, tuple[tuple[int, ...], str]]  # each saved tensor's global shape and dtype
Index = tuple[tuple[str, int], ...]  # a position on a saved tensor's leading axes: ("L", layer), ("E", expert)

# How an on-disk tensor is cut from its saved tensor: all of it (after the layer/expert index),
# the vocabulary's rows (Megatron pads the vocabulary), a query group's q, k or v rows, the gate
# or up half of `linear_fc1`, or every head's q, k and v rows in turn (a fused `qkv`).
WHOLE, VOCAB, Q, K, V, GATE, UP, QKV = "whole", "vocab", "q", "k", "v", "gate", "up", "qkv"

_LAYERS = "decoder.layers."
_ATTENTION = _LAYERS + "self_attention."
_QKV = _ATTENTION + "linear_qkv."
_EXPERTS = _LAYERS + "mlp.experts.experts."
_SHARED = _LAYERS + "mlp.shared_experts."
# (on-disk name, Megatron names it may be saved under, the cut); {L} is a layer, {E} an expert.
_RULES = (
    ("model.embed_tokens.weight", ("embedding.word_embeddings.weight",), VOCAB),
    ("lm_head.weight", ("output_layer.weight",), VOCAB),
    ("model.norm.weight", ("decoder.final_layernorm.weight",), WHOLE),
    ("model.layers.{L}.input_layernorm.weight", (_QKV + "layer_norm_weight", _LAYERS + "input_layernorm.weight"), WHOLE),
    ("model.layers.{L}.self_attn.q_proj.weight", (_QKV + "weight",), Q),
    ("model.layers.{L}.self_attn.k_proj.weight", (_QKV + "weight",), K),
    ("model.layers.{L}.self_attn.v_proj.weight", (_QKV + "weight",), V),
    ("model.layers.{L}.self_attn.q_proj.bias", (_QKV + "bias",), Q),
    ("model.layers.{L}.self_attn.k_proj.bias", (_QKV + "bias",), K),
    ("model.layers.{L}.self_attn.v_proj.bias", (_QKV + "bias",), V),
    ("model.layers.{L}.self_attn.o_proj.weight", (_LAYERS + "self_attention.linear_proj.weight",), WHOLE),
    ("model.layers.{L}.self_attn.q_norm.weight", (_LAYERS + "self_attention.q_layernorm.weight",), WHOLE),
    ("model.layers.{L}.self_attn.k_norm.weight", (_LAYERS + "self_attention.k_layernorm.weight",), WHOLE),
    ("model.layers.{L}.post_attention_layernorm.weight",
     (_LAYERS + "mlp.linear_fc1.layer_norm_weight", _LAYERS + "pre_mlp_layernorm.weight"), WHOLE),
    ("model.layers.{L}.mlp.gate_proj.weight", (_LAYERS + "mlp.linear_fc1.weight",), GATE),
    ("model.layers.{L}.mlp.up_proj.weight", (_LAYERS + "mlp.linear_fc1.weight",), UP),
    ("model.layers.{L}.mlp.down_proj.weight", (_LAYERS + "mlp.linear_fc2.weight",), WHOLE),
    # MoE: Qwen3-MoE's names (Qwen2-MoE's and GLM-4.5's too), then Mixtral's
    ("model.layers.{L}.mlp.gate.weight", (_LAYERS + "mlp.router.weight",), WHOLE),
    ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", (_EXPERTS + "linear_fc1.weight",), GATE),
    ("model.layers.{L}.mlp.experts.{E}.up_proj.weight", (_EXPERTS + "linear_fc1.weight",), UP),
    ("model.layers.{L}.mlp.experts.{E}.down_proj.weight", (_EXPERTS + "linear_fc2.weight",), WHOLE),
    ("model.layers.{L}.block_sparse_moe.gate.weight", (_LAYERS + "mlp.router.weight",), WHOLE),
    ("model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight", (_EXPERTS + "linear_fc1.weight",), GATE),
    ("model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight", (_EXPERTS + "linear_fc1.weight",), UP),
    ("model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight", (_EXPERTS + "linear_fc2.weight",), WHOLE),
    # DeepSeek-V3: multi-latent attention (q and kv each through a latent of their own, its norm
    # saved apart by the local spec or fused into the up projection by TE's), a shared expert and
    # the router's score-correction bias (GLM-4.5's too)
    ("model.layers.{L}.self_attn.q_proj.weight", (_ATTENTION + "linear_q_proj.weight",), WHOLE),  # no q latent
    ("model.layers.{L}.self_attn.q_a_proj.weight", (_ATTENTION + "linear_q_down_proj.weight",), WHOLE),
    ("model.layers.{L}.self_attn.q_a_layernorm.weight",
     (_ATTENTION + "linear_q_up_proj.layer_norm_weight", _ATTENTION + "q_layernorm.weight"), WHOLE),
    ("model.layers.{L}.self_attn.q_b_proj.weight", (_ATTENTION + "linear_q_up_proj.weight",), WHOLE),
    ("model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight", (_ATTENTION + "linear_kv_down_proj.weight",), WHOLE),
    ("model.layers.{L}.self_attn.kv_a_layernorm.weight",
     (_ATTENTION + "linear_kv_up_proj.layer_norm_weight", _ATTENTION + "kv_layernorm.weight"), WHOLE),
    ("model.layers.{L}.self_attn.kv_b_proj.weight", (_ATTENTION + "linear_kv_up_proj.weight",), WHOLE),
    ("model.layers.{L}.mlp.gate.e_score_correction_bias", (_LAYERS + "mlp.router.expert_bias",), WHOLE),
    ("model.layers.{L}.mlp.shared_experts.gate_proj.weight", (_SHARED + "linear_fc1.weight",), GATE),
    ("model.layers.{L}.mlp.shared_experts.up_proj.weight", (_SHARED + "linear_fc1.weight",), UP),
    ("model.layers.{L}.mlp.shared_experts.down_proj.weight", (_SHARED + "linear_fc2.weight",), WHOLE),
    # Qwen2-MoE: one shared expert (named in the singular) behind a sigmoid gate of its own
    ("model.layers.{L}.mlp.shared_expert.gate_proj.weight", (_SHARED + "linear_fc1.weight",), GATE),
    ("model.layers.{L}.mlp.shared_expert.up_proj.weight", (_SHARED + "linear_fc1.weight",), UP),
    ("model.layers.{L}.mlp.shared_expert.down_proj.weight", (_SHARED + "linear_fc2.weight",), WHOLE),
    ("model.layers.{L}.mlp.shared_expert_gate.weight", (_SHARED + "gate_weight",), WHOLE),
)
_VISION = "vision_model."
_VISION_LAYERS = _VISION + _LAYERS
# Qwen2.5-VL's vision tower (mbridge's names): each block's fused attention and gated MLP, with
# biases; the merger's norm is the tower's final norm, its MLP Megatron's projection.
_VISION_RULES = (
    ("visual.patch_embed.proj.weight", (_VISION + "patch_embed.proj.weight",), WHOLE),
    ("visual.blocks.{L}.norm1.weight", (_VISION_LAYERS + "self_attention.linear_qkv.layer_norm_weight",), WHOLE),
    ("visual.blocks.{L}.attn.qkv.weight", (_VISION_LAYERS + "self_attention.linear_qkv.weight",), QKV),
    ("visual.blocks.{L}.attn.qkv.bias", (_VISION_LAYERS + "self_attention.linear_qkv.bias",), QKV),
    ("visual.blocks.{L}.attn.proj.weight", (_VISION_LAYERS + "self_attention.linear_proj.weight",), WHOLE),
    ("visual.blocks.{L}.attn.proj.bias", (_VISION_LAYERS + "self_attention.linear_proj.bias",), WHOLE),
    ("visual.blocks.{L}.norm2.weight", (_VISION_LAYERS + "mlp.linear_fc1.layer_norm_weight",), WHOLE),
    ("visual.blocks.{L}.mlp.gate_proj.weight", (_VISION_LAYERS + "mlp.linear_fc1.weight",), GATE),
    ("visual.blocks.{L}.mlp.up_proj.weight", (_VISION_LAYERS + "mlp.linear_fc1.weight",), UP),
    ("visual.blocks.{L}.mlp.gate_proj.bias", (_VISION_LAYERS + "mlp.linear_fc1.bias",), GATE),
    ("visual.blocks.{L}.mlp.up_proj.bias", (_VISION_LAYERS + "mlp.linear_fc1.bias",), UP),
    ("visual.blocks.{L}.mlp.down_proj.weight", (_VISION_LAYERS + "mlp.linear_fc2.weight",), WHOLE),
    ("visual.blocks.{L}.mlp.down_proj.bias", (_VISION_LAYERS + "mlp.linear_fc2.bias",), WHOLE),
    ("visual.merger.ln_q.weight", (_VISION + "decoder.final_layernorm.weight",), WHOLE),
    ("visual.merger.mlp.0.weight", (_VISION + "projection.encoder.linear_fc1.weight",), WHOLE),
    ("visual.merger.mlp.0.bias", (_VISION + "projection.encoder.linear_fc1.bias",), WHOLE),
    ("visual.merger.mlp.2.weight", (_VISION + "projection.encoder.linear_fc2.weight",), WHOLE),
    ("visual.merger.mlp.2.bias", (_VISION + "projection.encoder.linear_fc2.bias",), WHOLE),
)
# The language model's prefix in the Megatron-Core names of each vision-language model type.
_LANGUAGE_PREFIXES = {"qwen2_5_vl": "language_model."}


def _patterns(rules, prefix: str = ""):
    """`rules` as (pattern of on-disk names, the Megatron names they are saved under, with
    `prefix`, the cut)."""
    return tuple(
        (re.compile("^" + re.escape(disk).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)") + "$"),
         tuple(prefix + name for name in saved), cut)
        for disk, saved, cut in rules
    )


_TEXT_PATTERNS = _patterns(_RULES)
_VLM_PATTERNS = {
    model_type: _patterns(_RULES, prefix) + _patterns(_VISION_RULES) for model_type, prefix in _LANGUAGE_PREFIXES.items()
}
# The Hugging Face model types whose every tensor the rules above name.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe",
               *_LANGUAGE_PREFIXES)
# Names only Megatron-Core gives, to recognise its checkpoints by.
_SIGNATURES = re.compile(
    r"^(language_model\.|vision_model\.)?"
    r"(embedding\.word_embeddings\.weight|output_layer\.weight|decoder\.(layers|final_layernorm)\..*)$"
)


def megatron_names(names: Iterable[str]) -> list[str]:
    """The names among `names` that only Megatron-Core gives (empty: not a Megatron checkpoint)."""
    return [name for name in names if _SIGNATURES.match(name)]


def megatron_namings(saved: Saved) -> Callable[[dict, Naming], dict[str, ProducerNaming]]:
    """The `Checkpoint.producer_namings` of a checkpoint whose tensors are `saved`: Megatron's
    naming of the model whose config.json and on-disk naming it is given."""
    def namings(config: dict, disk: Naming) -> dict[str, ProducerNaming]:
        return {PRODUCER: megatron_naming(config, disk, saved)}

    return namings


def megatron_naming(config: dict, disk: Naming, saved: Saved) -> ProducerNaming:
    """Megatron's naming of the model whose config.json is `config` and on-disk naming `disk`,
    each on-disk tensor as its box of the `saved` tensor it is cut from, or one line naming the
    model type, tensor or size that does not fit."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ExportError(
            f"Megatron-Core checkpoints of model type '{model_type}' are not mapped to Hugging Face names "
            f"(rayexport maps {', '.join(MODEL_TYPES)}); check --hf-config"
        )
    patterns = _VLM_PATTERNS.get(model_type, _TEXT_PATTERNS)
    rows = _attention_rows(config)
    expected: Saved = {}
    tiles: dict[str, tuple[Tile, ...]] = {}
    for name, (shape, _) in disk.expected.items():
        source, index, cut = _source_of(name, saved, disk.aliases, patterns)
        if source not in saved:
            continue  # a tied alias the checkpoint does not hold
        expected[source] = saved[source]
        tiles[name] = _cut(name, source, saved[source][0], index, tuple(shape), cut, rows)
    aliases = {}
    for alias, canonical in disk.aliases.items():
        alias_source, canonical_source = (_source_of(name, saved, disk.aliases, patterns)[0] for name in (alias, canonical))
        if canonical_source in expected:
            aliases[alias_source] = canonical_source
            expected.setdefault(alias_source, expected[canonical_source])
    return ProducerNaming(Naming(expected, aliases), tiles)


def _source_of(name: str, saved: Saved, aliases: dict[str, str], patterns) -> tuple[str, Index, str]:
    """The saved tensor that on-disk tensor `name` is cut from, where in it (a layer and an expert
    index on its leading axes), and the cut; of the saved names (in `patterns`) that can hold it,
    the one the checkpoint has. A layer's tensors are stacked on a leading axis
    (`decoder.layers.X`) unless its layers differ (dense and MoE ones, as DeepSeek-V3's): then
    each layer's are saved apart, as `decoder.layers.<L>.X`."""
    candidates = []
    for pattern, sources, cut in patterns:
        found = pattern.match(name)
        if not found:
            continue
        index = tuple((axis, int(position)) for axis, position in found.groupdict().items() if position is not None)
        for source in sources:
            candidates.append((source, index, cut))
            tower, layers, rest = source.partition(_LAYERS)
            if index and index[0][0] == "L" and layers:
                candidates.append((f"{tower}{_LAYERS}{index[0][1]}.{rest}", index[1:], cut))
    if not candidates:
        raise ExportError(f"tensor '{name}' of the config's model has no Megatron-Core name rayexport knows")
    held = next((candidate for candidate in candidates if candidate[0] in saved), None)
    if held is None and name not in aliases:
        raise ExportError(f"the Megatron-Core checkpoint has no tensor '{candidates[0][0]}', which '{name}' is cut from")
    return held or candidates[0]


def _attention_rows(config: dict) -> dict[str, dict[str, int]]:
    """The sizes that place q, k and v rows in `linear_qkv`, by cut (Q, K and V: the language
    model's, QKV: the vision tower's): heads, query groups, head size."""
    text = config.get("text_config") or config
    heads = text["num_attention_heads"]
    groups = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    rows = dict.fromkeys((Q, K, V), {"heads": heads, "groups": groups, "head_dim": head_dim})
    if vision := config.get("vision_config"):
        heads = vision["num_heads"]
        rows[QKV] = {"heads": heads, "groups": heads, "head_dim": vision["hidden_size"] // heads}
    return rows


def _cut(
    name: str, source: str, source_shape: tuple[int, ...], index: Index, shape: tuple[int, ...], cut: str,
    rows: dict[str, int],
) -> tuple[Tile, ...]:
    """On-disk tensor `name` (of `shape`) as the tiles of saved tensor `source` that `cut` takes
    at layer/expert `index`, after checking that the saved sizes agree with the config's."""
    for (axis, position), limit in zip(index, source_shape):
        if position >= limit:
            what = {"L": "layer", "E": "expert"}[axis]
            raise ExportError(
                f"'{name}' needs {what} {position} of Megatron-Core tensor '{source}', which holds {limit} "
                f"(shape {list(source_shape)}); check --hf-config"
            )
    inner = source_shape[len(index):]
    positions = tuple(position for _, position in index)
    if cut in (Q, K, V):
        return _attention_tiles(name, source, source_shape, positions, shape, cut, rows[cut])
    if cut == QKV:
        return _fused_attention_tiles(name, source, source_shape, positions, shape, rows[cut])
    if cut == VOCAB:  # rows past the vocabulary are Megatron's padding, dropped
        blocks, fits = [(0, 0, shape[0])], inner[1:] == shape[1:] and inner[0] >= shape[0]
    elif cut in (GATE, UP):
        blocks = [(0, 0 if cut == GATE else shape[0], shape[0])]
        fits = inner == (2 * shape[0], *shape[1:])
    else:
        blocks, fits = [(0, 0, shape[0])] if shape else [], inner == shape
    if not fits:
        raise ExportError(
            f"Megatron-Core tensor '{source}' has shape {list(source_shape)}, which has no {cut} part of shape "
            f"{list(shape)} for '{name}'; check --hf-config"
        )
    return _boxes(source, positions, shape, blocks)


def _attention_tiles(
    name: str, source: str, source_shape: tuple[int, ...], index: tuple[int, ...], shape: tuple[int, ...], cut: str,
    rows: dict[str, int],
) -> tuple[Tile, ...]:
    """q, k or v of `linear_qkv` (weight or bias) at layer `index`. Its rows come a query group
    at a time, [the group's q heads ; its k head ; its v head], `head_dim` rows a head: a tile
    per group."""
    heads, groups, head_dim = rows["heads"], rows["groups"], rows["head_dim"]
    per_group = heads // groups
    block = (per_group + 2) * head_dim
    inner = source_shape[len(index):]
    if heads % groups or inner[0] != groups * block or inner[1:] != shape[1:]:
        raise ExportError(
            f"Megatron-Core tensor '{source}' has shape {list(source_shape)}, not {groups} query groups of "
            f"{per_group} q heads, a k and a v head of {head_dim} rows each (the config's sizes); check --hf-config"
        )
    start, length = {Q: (0, per_group), K: (per_group, 1), V: (per_group + 1, 1)}[cut]
    start, length = start * head_dim, length * head_dim
    if shape[0] != groups * length:
        raise ExportError(f"'{name}' has {shape[0]} rows, not the {groups * length} that '{source}' holds for it")
    return _boxes(source, index, shape, [(group * length, group * block + start, length) for group in range(groups)])


def _fused_attention_tiles(
    name: str, source: str, source_shape: tuple[int, ...], index: tuple[int, ...], shape: tuple[int, ...],
    rows: dict[str, int],
) -> tuple[Tile, ...]:
    """A fused `qkv` (weight or bias) at layer `index`: every head's q rows, then every head's k
    rows, then v's, from `linear_qkv`, whose rows come a head at a time, [q ; k ; v]."""
    heads, head_dim = rows["heads"], rows["head_dim"]
    inner = source_shape[len(index):]
    if inner != shape or shape[0] != 3 * heads * head_dim:
        raise ExportError(
            f"Megatron-Core tensor '{source}' has shape {list(source_shape)}, not {heads} heads of q, k and v rows "
            f"({head_dim} each, the config's sizes) for '{name}' of shape {list(shape)}; check --hf-config"
        )
    return _boxes(source, index, shape, [
        ((part * heads + head) * head_dim, (3 * head + part) * head_dim, head_dim)
        for part in range(3) for head in range(heads)
    ])


def _boxes(
    source: str, index: tuple[int, ...], shape: tuple[int, ...], blocks: list[tuple[int, int, int]]
) -> tuple[Tile, ...]:
    """The tiles of a target of `shape` that take, for each (target row, source row, rows) of
    `blocks`, those rows of `source`'s tensor at layer/expert `index` (a 0-D target: its one
    element)."""
    lead = len(index)
    if not shape:
        return (Tile(source, (), (), index, ()),)
    rest = (0,) * (len(shape) - 1)
    axes = tuple(range(lead, lead + len(shape)))
    return tuple(
        Tile(source, (target_row, *rest), (rows, *shape[1:]), (*index, source_row, *rest), axes)
        for target_row, source_row, rows in blocks
    )
