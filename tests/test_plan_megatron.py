"""Megatron-Core's names planned into a model's on-disk tensors, without Ray or Megatron: a
Megatron state is built here from a Hugging Face state the way Megatron-Core lays its tensors
out (layers stacked, q/k/v rows a query group at a time, [gate ; up], experts stacked, the
vocabulary padded), sharded over ranks, and every output tensor assembled from the pieces the
planning asks for must be the Hugging Face tensor it came from. tests/test_megatron.py checks the
same rules against mbridge's export of real Megatron-Core checkpoints."""

import pytest
import torch
import transformers

from rayexport.common.errors import ExportError
from rayexport.model.conversion import model_formats
from rayexport.model.description import build_meta_model, expected_tensors
from rayexport.plan.megatron import megatron_names, megatron_namings
from rayexport.plan.naming import match_names
from rayexport.plan.ties import find_tie_aliases
from support.models import tiny_format_config
from support.plan_cases import assembled

WORLD_SIZE = 3  # row shards that cut through layers and experts
PADDED_VOCAB = 128  # Megatron pads the vocabulary (96 here) to a multiple of its TP size times 128


def dense_config(model_type: str, tied: bool, layers: int = 3, groups: int = 2):
    sizes = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=6,
                 num_key_value_heads=groups, tie_word_embeddings=tied)
    if model_type == "qwen2":
        config = transformers.Qwen2Config(**sizes)
    elif model_type == "qwen3":
        config = transformers.Qwen3Config(**sizes, head_dim=12)
    else:
        config = transformers.LlamaConfig(**sizes, head_dim=8)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def hf_state(config, seed=0):
    """Random on-disk tensors of the config's model (its tied alias left out)."""
    model = build_meta_model(config, False)
    disk = model_formats(model, expected_tensors(model), find_tie_aliases(model)).disk
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, (shape, _) in disk.expected.items() if name not in disk.aliases}


def megatron_state(hf, config):
    """`hf` laid out as Megatron-Core saves it (this test's own writing of its layout)."""
    layers = config.num_hidden_layers
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    per_group = heads // groups

    def layer(name):
        return [hf[name.format(L=index)] for index in range(layers)]

    def stacked(name):
        return torch.stack(layer(name))

    def qkv(kind):
        stacked_layers = []
        for index in range(layers):
            q, k, v = (hf[f"model.layers.{index}.self_attn.{part}_proj.{kind}"] for part in "qkv")
            q, k, v = q.chunk(groups), k.chunk(groups), v.chunk(groups)
            assert q[0].shape[0] == per_group * k[0].shape[0]
            stacked_layers.append(torch.cat([torch.cat([q[g], k[g], v[g]]) for g in range(groups)]))
        return torch.stack(stacked_layers)

    def padded(tensor):
        return torch.cat([tensor, torch.zeros(PADDED_VOCAB - tensor.shape[0], tensor.shape[1])])

    state = {
        "embedding.word_embeddings.weight": padded(hf["model.embed_tokens.weight"]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "decoder.layers.self_attention.linear_qkv.weight": qkv("weight"),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": stacked("model.layers.{L}.input_layernorm.weight"),
        "decoder.layers.self_attention.linear_proj.weight": stacked("model.layers.{L}.self_attn.o_proj.weight"),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": stacked("model.layers.{L}.post_attention_layernorm.weight"),
    }
    if "lm_head.weight" in hf:
        state["output_layer.weight"] = padded(hf["lm_head.weight"])
    if "model.layers.0.self_attn.q_proj.bias" in hf:
        state["decoder.layers.self_attention.linear_qkv.bias"] = qkv("bias")
    if "model.layers.0.self_attn.q_norm.weight" in hf:
        state["decoder.layers.self_attention.q_layernorm.weight"] = stacked("model.layers.{L}.self_attn.q_norm.weight")
        state["decoder.layers.self_attention.k_layernorm.weight"] = stacked("model.layers.{L}.self_attn.k_norm.weight")
    if "model.layers.0.mlp.gate_proj.weight" in hf:
        gates, ups = layer("model.layers.{L}.mlp.gate_proj.weight"), layer("model.layers.{L}.mlp.up_proj.weight")
        state["decoder.layers.mlp.linear_fc1.weight"] = torch.stack([torch.cat(pair) for pair in zip(gates, ups)])
        state["decoder.layers.mlp.linear_fc2.weight"] = stacked("model.layers.{L}.mlp.down_proj.weight")
    else:
        mixtral = "model.layers.0.block_sparse_moe.gate.weight" in hf
        moe = "block_sparse_moe" if mixtral else "mlp"
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        experts = config.num_local_experts if mixtral else config.num_experts

        def experts_of(index, part):
            return [hf[f"model.layers.{index}.{moe}.experts.{expert}.{part}.weight"] for expert in range(experts)]

        state["decoder.layers.mlp.router.weight"] = stacked(f"model.layers.{{L}}.{moe}.gate.weight")
        state["decoder.layers.mlp.experts.experts.linear_fc1.weight"] = torch.stack([
            torch.stack([torch.cat(pair) for pair in zip(experts_of(index, gate), experts_of(index, up))])
            for index in range(layers)
        ])
        state["decoder.layers.mlp.experts.experts.linear_fc2.weight"] = torch.stack(
            [torch.stack(experts_of(index, down)) for index in range(layers)]
        )
    return state


def formats_of(config, state):
    model = build_meta_model(config, False)
    formats = model_formats(model, expected_tensors(model), find_tie_aliases(model))
    saved = {name: (tuple(tensor.shape), "float32") for name, tensor in state.items()}
    return formats.with_producers(megatron_namings(saved)(config.to_dict(), formats.disk))


def exported(state, formats):
    return assembled(state, formats, WORLD_SIZE)


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False)])
def test_dense_models_come_back_tensor_for_tensor(model_type, tied):
    config = dense_config(model_type, tied)
    hf = hf_state(config)
    state = megatron_state(hf, config)
    planning, tensors = exported(state, formats_of(config, state))
    assert planning.naming == "megatron"
    assert set(tensors) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(tensors[name], tensor), name


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])
def test_moe_experts_come_back_from_their_layer_and_expert_index(architecture):
    config = tiny_format_config(architecture)
    hf = hf_state(config)
    state = megatron_state(hf, config)
    _, tensors = exported(state, formats_of(config, state))
    assert set(tensors) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(tensors[name], tensor), name


def vision_language_state(hf, config):
    """A Qwen2.5-VL's `hf` laid out as Megatron-Core saves it through mbridge: the language model
    under `language_model.`, the vision tower under `vision_model.`, its fused qkv rows a head at
    a time, [q ; k ; v]."""
    text = {name: tensor for name, tensor in hf.items() if not name.startswith("visual.")}
    state = {f"language_model.{name}": tensor for name, tensor in megatron_state(text, config.text_config).items()}
    vision = config.vision_config
    heads, head_dim = vision.num_heads, vision.hidden_size // vision.num_heads

    def stacked(name):
        return torch.stack([hf[name.format(L=index)] for index in range(vision.depth)])

    def per_head(name):  # [all q ; all k ; all v] -> [q ; k ; v] of each head in turn
        parts = stacked(name).unflatten(1, (3, heads, head_dim))
        return parts.transpose(1, 2).flatten(1, 3)

    def gate_up(kind):
        return torch.cat([stacked(f"visual.blocks.{{L}}.mlp.{part}_proj.{kind}") for part in ("gate", "up")], dim=1)

    layers = "vision_model.decoder.layers."
    state.update({
        "vision_model.patch_embed.proj.weight": hf["visual.patch_embed.proj.weight"],
        layers + "self_attention.linear_qkv.layer_norm_weight": stacked("visual.blocks.{L}.norm1.weight"),
        layers + "self_attention.linear_qkv.weight": per_head("visual.blocks.{L}.attn.qkv.weight"),
        layers + "self_attention.linear_qkv.bias": per_head("visual.blocks.{L}.attn.qkv.bias"),
        layers + "self_attention.linear_proj.weight": stacked("visual.blocks.{L}.attn.proj.weight"),
        layers + "self_attention.linear_proj.bias": stacked("visual.blocks.{L}.attn.proj.bias"),
        layers + "mlp.linear_fc1.layer_norm_weight": stacked("visual.blocks.{L}.norm2.weight"),
        layers + "mlp.linear_fc1.weight": gate_up("weight"),
        layers + "mlp.linear_fc1.bias": gate_up("bias"),
        layers + "mlp.linear_fc2.weight": stacked("visual.blocks.{L}.mlp.down_proj.weight"),
        layers + "mlp.linear_fc2.bias": stacked("visual.blocks.{L}.mlp.down_proj.bias"),
        "vision_model.decoder.final_layernorm.weight": hf["visual.merger.ln_q.weight"],
    })
    for index, fc in ((0, "linear_fc1"), (2, "linear_fc2")):
        for kind in ("weight", "bias"):
            state[f"vision_model.projection.encoder.{fc}.{kind}"] = hf[f"visual.merger.mlp.{index}.{kind}"]
    return state


def test_a_vision_language_model_comes_back_from_both_towers():
    """Qwen2.5-VL: its language model and vision tower (each head's q, k and v rows gathered
    into Hugging Face's [all q ; all k ; all v]) tensor for tensor; the tied head is left out.
    tests/test_megatron.py checks the same against mbridge's own conversion."""
    config = tiny_format_config("qwen2_5_vl")
    hf = hf_state(config)
    state = vision_language_state(hf, config)
    assert megatron_names(state) and not megatron_names(hf)
    planning, tensors = exported(state, formats_of(config, state))
    assert planning.naming == "megatron" and "lm_head.weight" not in tensors
    assert set(tensors) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(tensors[name], tensor), name


def test_a_vision_tower_with_other_heads_than_the_checkpoint_is_one_line():
    """A head count that does not cut the saved qkv rows into whole heads is refused by name.
    (One that does, with the same width, fits every shape: only config.json tells it.)"""
    config = tiny_format_config("qwen2_5_vl")
    state = vision_language_state(hf_state(config), config)
    config.vision_config.num_heads = 3
    with pytest.raises(ExportError, match=r"'vision_model\.decoder\.layers\.self_attention\.linear_qkv\.(weight|bias)' has shape "
                                          r"\[2, 96.*\], not 3 heads of q, k and v rows .*check --hf-config"):
        formats_of(config, state)


def test_layers_saved_apart_are_found_by_their_layer_number():
    """Where a model's layers differ (DeepSeek-V3's dense then MoE ones), Megatron-Core saves
    each layer's tensors apart, as `decoder.layers.<L>.X` with no layer axis."""
    config = tiny_format_config("qwen3_moe")
    hf = hf_state(config)
    apart = {}
    for key, tensor in megatron_state(hf, config).items():
        if key.startswith("decoder.layers."):
            apart.update({f"decoder.layers.{index}.{key.removeprefix('decoder.layers.')}": layer for index, layer in enumerate(tensor)})
        else:
            apart[key] = tensor
    _, tensors = exported(apart, formats_of(config, apart))
    assert set(tensors) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(tensors[name], tensor), name


def test_q_rows_taken_whole_instead_of_per_group_would_not_match():
    """The check above fails for a converter that splits linear_qkv into [q ; k ; v] blocks."""
    config = dense_config("llama", False)
    hf = hf_state(config)
    state = megatron_state(hf, config)
    q_rows = hf["model.layers.0.self_attn.q_proj.weight"].shape[0]
    assert not torch.equal(state["decoder.layers.self_attention.linear_qkv.weight"][0, :q_rows], hf["model.layers.0.self_attn.q_proj.weight"])


def test_megatron_names_are_recognised_and_hugging_faces_are_not():
    config = dense_config("llama", False)
    hf = hf_state(config)
    assert megatron_names(megatron_state(hf, config)) and not megatron_names(hf)


def test_a_config_with_other_heads_than_the_checkpoint_is_one_line():
    config = dense_config("llama", False)
    state = megatron_state(hf_state(config), config)
    other = dense_config("llama", False, groups=3)
    with pytest.raises(ExportError, match="not 3 query groups of 16 q, 8 k and 8 v rows.*check --hf-config"):
        formats_of(other, state)


def test_a_config_with_more_layers_than_the_checkpoint_is_one_line():
    config = dense_config("qwen2", False)
    state = megatron_state(hf_state(config), config)
    other = dense_config("qwen2", False, layers=4)
    with pytest.raises(ExportError, match="needs layer 3 of Megatron-Core tensor 'decoder.layers.self_attention.linear_qkv.weight', which holds 3"):
        formats_of(other, state)


def test_a_model_type_without_rules_is_refused_by_name():
    config = tiny_format_config("qwen2_vl")
    with pytest.raises(ExportError, match=r"architecture 'Qwen2VLForConditionalGeneration' \(model type 'qwen2_vl'\) are not mapped"):
        formats_of(config, {"embedding.word_embeddings.weight": torch.zeros(1, 1)})


def test_a_missing_megatron_tensor_is_named_before_any_read():
    config = dense_config("llama", True)
    state = megatron_state(hf_state(config), config)
    del state["decoder.layers.mlp.linear_fc2.weight"]
    with pytest.raises(ExportError, match="no tensor 'decoder.layers.mlp.linear_fc2.weight', which 'model.layers.0.mlp.down_proj.weight' is cut from"):
        match_names(state, formats_of(config, state))


def test_a_saved_head_of_a_tied_model_is_compared_then_dropped():
    config = dense_config("llama", True)
    state = megatron_state(hf_state(config), config)
    state["output_layer.weight"] = state["embedding.word_embeddings.weight"].clone()
    planning, tensors = exported(state, formats_of(config, state))
    assert "lm_head.weight" not in tensors
    assert planning.tied_key_pairs == [("embedding.word_embeddings.weight", "output_layer.weight")]


def test_megatron_names_read_as_plain_dcp_point_at_the_megatron_layout():
    """`--layout dcp` on a dist_ckpt/ folder: the names are Megatron's, and the line says so."""
    config = dense_config("llama", False)
    state = megatron_state(hf_state(config), config)
    model = build_meta_model(config, False)
    formats = model_formats(model, expected_tensors(model), find_tie_aliases(model))
    with pytest.raises(ExportError, match=r"these look like megatron names \(.*\): read them with --layout megatron"):
        match_names(state, formats)


def mtp_layer_state(hf, config):
    """Hugging Face's MTP layer (Qwen3-Next's and Qwen3.5's names, `mtp.*`) laid out as
    Megatron-Core saves it: `mtp.layers.0.` for the layer's own projection and norms, and its
    decoder layer under `transformer_layer.`, as `MultiTokenPredictionLayer.sharded_state_dict`
    names it."""
    groups = config.num_key_value_heads
    q, k, v = (hf[f"mtp.layers.0.self_attn.{part}_proj.weight"] for part in "qkv")
    layer = "mtp.layers.0.transformer_layer."
    return {
        "mtp.layers.0.eh_proj.weight": hf["mtp.fc.weight"],
        "mtp.layers.0.enorm.weight": hf["mtp.pre_fc_norm_embedding.weight"],
        "mtp.layers.0.hnorm.weight": hf["mtp.pre_fc_norm_hidden.weight"],
        "mtp.layers.0.final_layernorm.weight": hf["mtp.norm.weight"],
        layer + "self_attention.linear_qkv.weight": torch.cat(
            [torch.cat([q.chunk(groups)[g], k.chunk(groups)[g], v.chunk(groups)[g]]) for g in range(groups)]
        ),
        layer + "self_attention.linear_qkv.layer_norm_weight": hf["mtp.layers.0.input_layernorm.weight"],
        layer + "self_attention.q_layernorm.weight": hf["mtp.layers.0.self_attn.q_norm.weight"],
        layer + "self_attention.k_layernorm.weight": hf["mtp.layers.0.self_attn.k_norm.weight"],
        layer + "self_attention.linear_proj.weight": hf["mtp.layers.0.self_attn.o_proj.weight"],
        layer + "mlp.linear_fc1.layer_norm_weight": hf["mtp.layers.0.post_attention_layernorm.weight"],
        layer + "mlp.linear_fc1.weight": torch.cat([hf["mtp.layers.0.mlp.gate_proj.weight"], hf["mtp.layers.0.mlp.up_proj.weight"]]),
        layer + "mlp.linear_fc2.weight": hf["mtp.layers.0.mlp.down_proj.weight"],
    }


def test_mtp_layers_are_exported_beyond_the_models_class():
    """A save with a multi-token-prediction layer (MiMo's on Qwen3, as Megatron-Bridge's Qwen3
    bridge maps it) exports it under Hugging Face's names, each of a decoder layer's tensors
    shaped as the last decoder layer's, the layer's own projection and norms as saved; the names
    are on-disk names the model's class has no place for (`beyond_model`)."""
    config = dense_config("qwen3", False)
    hf = hf_state(config)
    generator = torch.Generator().manual_seed(1)
    last = f"model.layers.{config.num_hidden_layers - 1}."
    mtp = {f"mtp.layers.0.{name[len(last):]}": torch.randn(tensor.shape, generator=generator)
           for name, tensor in hf.items() if name.startswith(last)}
    hidden = config.hidden_size
    mtp.update({"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=generator),
                **{f"mtp.{norm}.weight": torch.randn(hidden, generator=generator)
                   for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}})
    state = {**megatron_state(hf, config), **mtp_layer_state(mtp, config)}
    config.mtp_num_hidden_layers = 1
    formats = formats_of(config, state)
    assert formats.beyond_model() == set(mtp)
    _, tensors = exported(state, formats)
    assert set(tensors) == set(hf) | set(mtp)
    for name, tensor in {**hf, **mtp}.items():
        assert torch.equal(tensors[name], tensor), name


@pytest.mark.parametrize("head,bias", [
    ("Qwen3ForTokenClassification", True), ("Qwen3ForTokenClassification", False), ("Qwen3ForSequenceClassification", False),
])
def test_a_critics_or_reward_models_output_layer_is_its_score_head(head, bias):
    """A critic (verl's Megatron critic: the GPT model with an output layer of one row) exported
    as the causal LM's token classifier, whose `score` has a bias: the output layer's, or zeros
    where it has none (verl's value head computes without); a reward model as its sequence
    classifier, whose `score` has none."""
    config = dense_config("qwen3", False)
    hf = hf_state(config)
    state = megatron_state(hf, config)
    state["output_layer.weight"] = torch.randn(1, config.hidden_size)
    if bias:
        state["output_layer.bias"] = torch.randn(1)
    critic = transformers.Qwen3Config(**{**config.to_dict(), "num_labels": 1, "id2label": {0: "value"}, "architectures": [head]})
    _, tensors = exported(state, formats_of(critic, state))
    assert "lm_head.weight" not in tensors and torch.equal(tensors["score.weight"], state["output_layer.weight"])
    if head.endswith("TokenClassification"):
        expected = state["output_layer.bias"] if bias else torch.zeros(1)
        assert torch.equal(tensors["score.bias"], expected) and (bias or not tensors["score.bias"].signbit().any())
    else:
        assert "score.bias" not in tensors
    assert all(torch.equal(tensors[name], tensor) for name, tensor in hf.items() if name != "lm_head.weight")
