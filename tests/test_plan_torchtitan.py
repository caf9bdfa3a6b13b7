"""torchtitan's names planned into a model's on-disk tensors, without Ray: each output tensor
assembled from FSDP row shards of torchtitan-named tensors, as the workers would send them,
equals what torchtitan's `to_hf` makes (its Llama q/k reordering written out as torchtitan's
adapter computes it). tests/test_torchtitan.py checks the same against torchtitan itself."""

import pytest
import torch
import transformers

from rayexport.common.errors import ExportError
from rayexport.model.conversion import model_formats
from rayexport.model.description import build_meta_model, expected_tensors
from rayexport.plan.formats import IN_MEMORY, ON_DISK
from rayexport.plan.naming import match_names
from rayexport.plan.ties import find_tie_aliases
from rayexport.plan.torchtitan import torchtitan_namings
from support.models import tiny_format_config
from support.plan_cases import assembled

WORLD_SIZE = 3  # row shards that cut through heads and pairs of rows


def transformers_formats(config):
    """The model's two namings, as transformers gives them."""
    model = build_meta_model(config, False)
    return model_formats(model, expected_tensors(model), find_tie_aliases(model))


def formats_of(config):
    """The model's namings with torchtitan's beside them, as a torchtitan checkpoint is planned."""
    formats = transformers_formats(config)
    return formats.with_producers(torchtitan_namings(config.to_dict(), formats.disk))


def llama_config(tied: bool):
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def random_state(naming, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator) for name, (shape, _) in naming.expected.items()
        if name not in naming.aliases
    }


def exported(state, formats, output_format=ON_DISK):
    return assembled(state, formats, WORLD_SIZE, output_format)


def to_hf_rows(weight, heads):
    """torchtitan's Llama adapter's reordering of q and k rows (its `_permute`)."""
    rows, columns = weight.shape
    return weight.view(heads, rows // heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


@pytest.mark.parametrize("generation", ["0.3", "0.2"])
def test_llama_q_and_k_rows_are_reordered_per_head_and_the_rest_renamed(generation):
    config = llama_config(tied=False)
    formats = formats_of(config)
    state = random_state(formats.naming(f"torchtitan {generation}"))
    planning, tensors = exported(state, formats)
    assert planning.naming == f"torchtitan {generation}" and set(tensors) == set(formats.disk.expected)
    attention = "attention.qkv_linear" if generation == "0.3" else "attention"
    assert torch.equal(tensors["model.layers.1.self_attn.q_proj.weight"], to_hf_rows(state[f"layers.1.{attention}.wq.weight"], 6))
    assert torch.equal(tensors["model.layers.1.self_attn.k_proj.weight"], to_hf_rows(state[f"layers.1.{attention}.wk.weight"], 2))
    assert torch.equal(tensors["model.layers.1.self_attn.v_proj.weight"], state[f"layers.1.{attention}.wv.weight"])
    assert torch.equal(tensors["model.layers.0.mlp.up_proj.weight"], state["layers.0.feed_forward.w3.weight"])
    head = "lm_head.weight" if generation == "0.3" else "output.weight"
    assert torch.equal(tensors["lm_head.weight"], state[head])


def test_a_llama_checkpoint_without_the_reordering_does_not_match():
    """The check above fails when the q rows are only renamed, as naive converters do."""
    formats = formats_of(llama_config(tied=False))
    state = random_state(formats.naming("torchtitan 0.3"))
    _, tensors = exported(state, formats)
    assert not torch.equal(tensors["model.layers.0.self_attn.q_proj.weight"], state["layers.0.attention.qkv_linear.wq.weight"])


def test_a_tied_head_saved_twice_is_compared_then_dropped():
    formats = formats_of(llama_config(tied=True))
    state = random_state(formats.naming("torchtitan 0.3"))
    state["lm_head.weight"] = state["tok_embeddings.weight"].clone()
    planning, tensors = exported(state, formats)
    assert "lm_head.weight" not in tensors
    assert planning.tied_key_pairs == [("tok_embeddings.weight", "lm_head.weight")]


def test_qwen3_moe_grouped_experts_become_each_experts_slice_unreordered():
    config = tiny_format_config("qwen3_moe")
    formats = formats_of(config)
    state = random_state(formats.naming("torchtitan 0.3"))
    grouped = state["layers.1.moe.routed_experts.inner_experts.w2_EDF"]
    assert grouped.shape == (4, 64, 32)  # [experts, dim, moe intermediate]
    _, tensors = exported(state, formats)
    for expert in range(4):
        assert torch.equal(tensors[f"model.layers.1.mlp.experts.{expert}.down_proj.weight"], grouped[expert])
    assert torch.equal(tensors["model.layers.0.self_attn.q_proj.weight"], state["layers.0.attention.qkv_linear.wq.weight"])
    assert torch.equal(tensors["model.layers.0.mlp.gate.weight"], state["layers.0.moe.router.gate.weight"])
    with pytest.raises(ExportError, match="exported in the on-disk format only"):
        exported(state, formats, IN_MEMORY)


def test_missing_torchtitan_tensors_are_named_in_torchtitans_names():
    formats = formats_of(tiny_format_config("qwen3"))
    names = [name for name in formats.naming("torchtitan 0.2").expected if "layers.1." not in name]
    with pytest.raises(ExportError, match=r"no tensor 'layers\.1\.attention\.wq\.weight' that the config's model needs \(and 10 more\)$"):
        match_names(names, formats)


def test_torchtitan_names_read_as_plain_dcp_say_what_they_look_like():
    config = tiny_format_config("qwen3")
    names = formats_of(config).naming("torchtitan 0.3").expected
    with pytest.raises(ExportError, match=r"these look like torchtitan names \(tok_embeddings\.weight, .*\): read them with --layout torchtitan"):
        match_names(names, transformers_formats(config))


def test_a_model_type_torchtitan_does_not_convert_is_refused_by_name():
    config = tiny_format_config("mixtral")
    with pytest.raises(ExportError, match="torchtitan checkpoints of model type 'mixtral' are not mapped"):
        torchtitan_namings(config.to_dict(), transformers_formats(config).disk)
