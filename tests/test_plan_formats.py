"""Choosing a checkpoint's naming and converting plans between namings, on the namings
transformers gives a tiny Qwen3-MoE (built on the meta device)."""

from dataclasses import replace

import pytest
import torch

from rayexport.common.errors import ExportError
from rayexport.model.conversion import model_formats
from rayexport.model.description import build_meta_model, expected_tensors
from rayexport.plan.formats import IN_MEMORY, ON_DISK, choose_naming, convert_plans
from rayexport.plan.naming import LoraMerge, plan_holdings
from rayexport.plan.pieces import holders_from_ranks
from rayexport.plan.ties import find_tie_aliases
from support.models import tiny_format_config
from support.plan_cases import assembled, fsdp2_ranks

FUSED = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def formats():
    model = build_meta_model(tiny_format_config("qwen3_moe"), False)
    return model_formats(model, expected_tensors(model), find_tie_aliases(model))


def test_the_naming_is_decided_from_all_the_keys(formats):
    assert choose_naming(formats.memory.expected, formats) == IN_MEMORY
    assert choose_naming(formats.disk.expected, formats) == ON_DISK
    assert choose_naming(["model.norm.weight"], formats) == IN_MEMORY  # in both: the same either way
    with pytest.raises(ExportError, match=f"in-memory name '{FUSED}' with the on-disk name 'model.layers.1.mlp.experts.0"):
        choose_naming([FUSED, "model.layers.1.mlp.experts.0.up_proj.weight"], formats)


def test_fused_experts_sharded_over_two_ranks_become_per_expert_slices(formats):
    shapes = {name: shape for name, (shape, _) in formats.memory.expected.items() if name not in formats.memory.aliases}
    holders = holders_from_ranks(fsdp2_ranks(shapes, 2))
    planning = plan_holdings(holders, formats, ON_DISK, "bfloat16")
    by_name = {plan.name: plan for plan in planning.tensors}
    assert set(by_name) == {name for name in formats.disk.expected if name not in formats.disk.aliases}
    up = by_name["model.layers.0.mlp.experts.3.up_proj.weight"]  # expert 3 of 4: rank 1 holds experts 2-3
    assert [(piece.rank, piece.source_key, piece.offset, piece.shape, piece.region) for piece in up.pieces] == [
        (1, FUSED, (0, 0), (32, 64), ((1, 1, 1), (32, 32, 1), (0, 64, 1)))
    ]
    assert up.dtype == "bfloat16" and planning.naming == IN_MEMORY


def test_lora_cannot_be_merged_into_a_tensor_that_is_split(formats):
    shapes = {name: shape for name, (shape, _) in formats.memory.expected.items() if name not in formats.memory.aliases}
    planning = plan_holdings(holders_from_ranks(fsdp2_ranks(shapes, 1)), formats, IN_MEMORY, None)
    plans = [replace(plan, lora=LoraMerge(plan, plan, 1.0)) if plan.name == FUSED else plan for plan in planning.tensors]
    with pytest.raises(ExportError, match=f"LoRA on '{FUSED}' cannot be merged into 'model.layers.0.mlp.experts.0.gate_proj.weight'"):
        convert_plans(plans, formats.tiles(IN_MEMORY, ON_DISK), formats.disk, IN_MEMORY, ON_DISK)


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])
def test_fused_experts_in_zeros_runs_become_transformers_own_per_expert_tensors(architecture):
    """ZeRO flattens the fused experts into runs that straddle experts and ranks: each on-disk
    expert tensor is cut from them, equal to what transformers' save conversion makes."""
    from transformers.core_model_loading import revert_weight_conversion

    model = build_meta_model(tiny_format_config(architecture), False)
    formats = model_formats(model, expected_tensors(model), find_tie_aliases(model))
    generator = torch.Generator().manual_seed(0)
    state = {
        name: torch.randn(shape, generator=generator) for name, (shape, _) in formats.memory.expected.items()
        if name not in formats.memory.aliases
    }
    planning, exported = assembled(state, formats, 3, partition="zero")
    reference = revert_weight_conversion(model, dict(state))
    assert planning.naming == IN_MEMORY and set(exported) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name
    straddling = [plan for plan in planning.tensors if len({piece.rank for piece in plan.pieces}) > 1 and "experts." in plan.name]
    assert straddling  # some expert's tensor is cut from two ranks' runs
