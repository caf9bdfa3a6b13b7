"""rayexport.plan.keys.normalize_key: wrapper components out, the model's own names kept."""

import pytest
import torch

from rayexport.plan.keys import normalize_key


@pytest.mark.parametrize(
    "key, expected",
    [
        ("_fsdp_wrapped_module.model.norm.weight", "model.norm.weight"),
        ("_checkpoint_wrapped_module.model.norm.weight", "model.norm.weight"),
        ("_orig_mod.model.norm.weight", "model.norm.weight"),
        ("module.model.norm.weight", "model.norm.weight"),
    ],
)
def test_each_wrapper_prefix_is_stripped(key, expected):
    assert normalize_key(key) == expected


def test_nested_wrappers_at_any_position():
    key = (
        "module._fsdp_wrapped_module._orig_mod.model.layers.0._fsdp_wrapped_module."
        "_checkpoint_wrapped_module.mlp.up_proj.weight"
    )
    assert normalize_key(key) == "model.layers.0.mlp.up_proj.weight"


def test_wrapper_as_last_component_before_leaf():
    assert normalize_key("lm_head._fsdp_wrapped_module.weight") == "lm_head.weight"


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.0.module.weight",  # "module." is only a wrapper at the very start
        "modules.0.weight",  # starts with "module" but not "module."
        "model.my_orig_mod.weight",  # wrapper names must match whole components
        "model._fsdp_wrapped_module_extra.weight",
        "model.embed_tokens.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",  # PEFT names untouched
    ],
)
def test_names_without_wrappers_are_unchanged(key):
    assert normalize_key(key) == key


def test_only_one_leading_module_prefix_is_removed():
    assert normalize_key("module.model.module.weight") == "model.module.weight"


def test_undoes_real_torch_wrappers():
    """Names produced by torch's own checkpoint wrapper and torch.compile map back to the
    unwrapped model's names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3))
    wrapped = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3))
    wrapped[0] = checkpoint_wrapper(wrapped[0])
    compiled = torch.compile(wrapped)
    wrapped_names = [name for name, _ in compiled.named_parameters()]
    assert any("_checkpoint_wrapped_module" in name for name in wrapped_names)
    assert all(name.startswith("_orig_mod.") for name in wrapped_names)
    assert [normalize_key(name) for name in wrapped_names] == [name for name, _ in plain.named_parameters()]
