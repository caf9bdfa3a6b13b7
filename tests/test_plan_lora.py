"""LoRA key handling, settings, planning and the merge, against peft's own merge."""

from __future__ import annotations

import math

import pytest
import torch

from rayexport.common.errors import ExportError
from rayexport.model.description import expected_tensors
from rayexport.plan.formats import IN_MEMORY, ModelFormats, Naming
from rayexport.plan.lora import (
    LoraSettings, adapter_config, adapter_tensor_name, fan_in_fan_out_weights, lora_settings, merge_lora,
    split_peft_names,
)
from rayexport.plan.naming import LoraRequest, plan_holdings
from rayexport.plan.pieces import holders_from_ranks
from rayexport.plan.shards import describe_tensor
from rayexport.transport.assembly import output_chunks

Q = "base_model.model.model.layers.0.self_attn.q_proj"


def test_split_maps_peft_names_to_model_names():
    names = [
        f"{Q}.base_layer.weight", f"{Q}.base_layer.bias", f"{Q}.lora_A.default.weight", f"{Q}.lora_B.default.weight",
        "base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight",
    ]
    base, targets = split_peft_names(names)
    assert base == {
        "model.layers.0.self_attn.q_proj.weight": f"{Q}.base_layer.weight",
        "model.layers.0.self_attn.q_proj.bias": f"{Q}.base_layer.bias",
        "model.embed_tokens.weight": "base_model.model.model.embed_tokens.weight",
        "lm_head.weight": "base_model.model.lm_head.weight",
    }
    assert [(t.module, t.a_name, t.b_name) for t in targets] == [
        ("model.layers.0.self_attn.q_proj", f"{Q}.lora_A.default.weight", f"{Q}.lora_B.default.weight")
    ]
    assert adapter_tensor_name(targets[0], "A") == f"{Q}.lora_A.weight"


@pytest.mark.parametrize("name, variant", [
    (f"{Q}.lora_magnitude_vector.default.weight", "DoRA"),
    ("base_model.model.score.modules_to_save.default.weight", "modules_to_save"),
    ("base_model.model.score.original_module.weight", "modules_to_save"),
    ("base_model.model.model.embed_tokens.lora_embedding_A.default", "embeddings"),
    (f"{Q}.lora_B.default.bias", "LoRA bias"),
])
def test_unmergeable_variants_are_refused_by_name(name, variant):
    with pytest.raises(ExportError, match=variant) as error:
        split_peft_names([f"{Q}.base_layer.weight", name])
    assert name in str(error.value)


def test_half_an_adapter_or_two_adapters_are_refused():
    with pytest.raises(ExportError, match="lora_A but not its other half"):
        split_peft_names([f"{Q}.base_layer.weight", f"{Q}.lora_A.default.weight"])
    with pytest.raises(ExportError, match="several LoRA adapters"):
        split_peft_names([f"{Q}.lora_A.a.weight", f"{Q}.lora_B.a.weight", f"{Q}.lora_A.b.weight", f"{Q}.lora_B.b.weight"])


def test_settings_come_from_meta_and_overrides_and_never_zero_alpha():
    settings = lora_settings({"r": 8, "lora_alpha": 16, "task_type": "CAUSAL_LM"}, 8, {"lora_alpha": None})
    assert settings == LoraSettings(r=8, alpha=16, use_rslora=False, task_type="CAUSAL_LM") and settings.scale == 2.0
    assert lora_settings(None, 4, {"lora_alpha": 8, "use_rslora": True}).scale == 8 / math.sqrt(4)
    with pytest.raises(ExportError, match="--lora-alpha"):
        lora_settings(None, 4, {})
    with pytest.raises(ExportError, match="lora_alpha is 0"):
        lora_settings({"r": 4, "lora_alpha": 0}, 4, {})
    with pytest.raises(ExportError, match="r is 8 but the saved adapter has rank 4"):
        lora_settings({"r": 8, "lora_alpha": 8}, 4, {})


def conv1d(nf: int, nx: int) -> torch.nn.Module:
    from transformers.pytorch_utils import Conv1D

    return Conv1D(nf, nx)  # GPT-2's layer: weight stored (in=nx, out=nf)


LAYERS = {
    "linear": lambda: torch.nn.Linear(16, 12),
    "conv1d": lambda: conv1d(12, 16),
    "conv1d-square": lambda: conv1d(16, 16),  # shapes alone cannot tell its orientation
}


@pytest.mark.parametrize("first_rows", [1, 2], ids=["uneven-rows", "even-rows"])
@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_planned_merge_equals_peft_merge_and_unload(layer, use_rslora, first_rows):
    """The layer's weight, A and B sharded over two ranks, planned and merged as the exporter
    does: A and B take the layer's own orientation (Conv1D stores W as (in, out), and peft
    merges its delta transposed), and the result is peft's merge_and_unload. r is not given:
    it is read from the saved adapter, also where lora_A's plain row shards are equal (2 + 2
    rows of r=4, which look like two replicas of a rank-2 A)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential()
    base.add_module("proj", LAYERS[layer]())
    expected, transposed = expected_tensors(base), fan_in_fan_out_weights(base)
    assert transposed == (frozenset() if layer == "linear" else {"proj.weight"})
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], use_rslora=use_rslora))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_()
    # FSDP1-style plain row shards
    parts = (slice(0, first_rows), slice(first_rows, None))
    states = [{key: value.detach()[rows].clone() for key, value in model.state_dict().items()} for rows in parts]
    holders = holders_from_ranks({rank: {key: describe_tensor(value, rank) for key, value in state.items()}
                                  for rank, state in enumerate(states)})
    request = LoraRequest(meta={"lora_alpha": 8, "use_rslora": use_rslora}, fan_in_fan_out=transposed)
    planning = plan_holdings(holders, ModelFormats.same(Naming(expected)), IN_MEMORY, None, request)
    (plan,) = [plan for plan in planning.tensors if plan.lora is not None]
    merged = torch.cat(output_chunks(plan, {piece: states[piece.rank][piece.source_key] for piece in plan.all_pieces}))
    torch.testing.assert_close(merged, model.merge_and_unload().proj.weight, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
def test_a_box_or_run_of_the_weight_merges_bit_for_bit_as_in_the_whole(fan_in_fan_out):
    """A worker holding one shard of W recomputes exactly the bytes the exporter wrote for it
    (the verification's reference), whatever blocks either merge runs in."""
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(1100, 1000, generator=generator).to(torch.bfloat16)  # more than one block
    out_features, in_features = base.shape[::-1] if fan_in_fan_out else base.shape
    a, b = torch.randn(8, in_features, generator=generator), torch.randn(out_features, 8, generator=generator)
    whole = torch.cat(list(merge_lora(base, a, b, 0.7, fan_in_fan_out)))
    assert whole.dtype == torch.float32 and len(list(merge_lora(base, a, b, 0.7, fan_in_fan_out))) > 1
    for rows, columns in ((slice(300, 777), slice(0, 1000)), (slice(1050, 1100), slice(250, 600)), (slice(5, 5), slice(0, 9))):
        box = torch.cat(list(merge_lora(base[rows, columns], a, b, 0.7, fan_in_fan_out, (rows.start, columns.start))))
        assert torch.equal(box, whole[rows, columns])
    flat = base.reshape(-1)
    for start, stop in ((0, flat.numel()), (123_457, 654_321), (999, 1001), (7, 7)):  # runs, as ZeRO-3 partitions W
        run = torch.cat(list(merge_lora(flat[start:stop], a, b, 0.7, fan_in_fan_out, (start,))))
        assert torch.equal(run, whole.reshape(-1)[start:stop]), (start, stop)
    delta = b @ a
    torch.testing.assert_close(whole, base.float() + 0.7 * (delta.T if fan_in_fan_out else delta), rtol=1e-5, atol=1e-4)


def test_lora_on_a_weight_that_is_not_2d_is_refused_by_name():
    module = "base_model.model.conv"
    shapes = {f"{module}.base_layer.weight": (6, 3, 2, 2), f"{module}.lora_A.default.weight": (4, 3, 2, 2),
              f"{module}.lora_B.default.weight": (6, 4, 1, 1)}
    holders = holders_from_ranks({0: {key: describe_tensor(torch.zeros(shape), 0) for key, shape in shapes.items()}})
    formats = ModelFormats.same(Naming({"conv.weight": ((6, 3, 2, 2), "float32")}))
    with pytest.raises(ExportError, match="LoRA module 'conv' has a 4-D weight"):
        plan_holdings(holders, formats, IN_MEMORY, None, LoraRequest(meta={"r": 4, "lora_alpha": 8}))


def test_adapter_config_is_peft_loadable():
    from peft import LoraConfig

    _, targets = split_peft_names([f"{Q}.base_layer.weight", f"{Q}.lora_A.default.weight", f"{Q}.lora_B.default.weight"])
    config = adapter_config(LoraSettings(r=4, alpha=8, use_rslora=True, task_type="CAUSAL_LM"), targets, "s3://b/base")
    loaded = LoraConfig.from_peft_type(**config)
    assert (loaded.r, loaded.lora_alpha, loaded.use_rslora, loaded.task_type) == (4, 8, True, "CAUSAL_LM")
    assert set(loaded.target_modules) == {"q_proj"} and loaded.base_model_name_or_path == "s3://b/base"


def test_the_adapter_file_names_are_peft_s():
    from peft.utils.constants import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

    from rayexport.plan.lora import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS

    assert ADAPTER_WEIGHTS == f"{ADAPTER_DIR}/{SAFETENSORS_WEIGHTS_NAME}"
    assert ADAPTER_CONFIG == f"{ADAPTER_DIR}/{CONFIG_NAME}"
