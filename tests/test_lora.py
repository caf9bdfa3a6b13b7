"""LoRA key handling, settings and the merge, against peft's own merge."""

from __future__ import annotations

import math

import pytest
import torch

from rayexport.errors import ExportError
from rayexport.lora import (
    LoraSettings, adapter_config, adapter_tensor_name, lora_settings, merge_lora, split_peft_names,
)

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
    with pytest.raises(ExportError, match="r is 8 but lora_A holds rank 4"):
        lora_settings({"r": 8, "lora_alpha": 8}, 4, {})


@pytest.mark.parametrize("use_rslora", [False, True])
def test_merge_equals_peft_merge_and_unload(use_rslora):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    layer = torch.nn.Sequential()
    layer.add_module("proj", torch.nn.Linear(16, 12))
    model = get_peft_model(layer, LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], use_rslora=use_rslora))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_()
    proj = model.base_model.model.proj
    base, a, b = proj.base_layer.weight.clone(), proj.lora_A["default"].weight, proj.lora_B["default"].weight
    settings = LoraSettings(r=4, alpha=8, use_rslora=use_rslora, task_type=None)
    merged = merge_lora(base, a, b, settings.scale)
    torch.testing.assert_close(merged, model.merge_and_unload().proj.weight, rtol=0, atol=1e-6)


def test_merge_computes_in_float32_from_bfloat16():
    base = torch.randn(8, 8).to(torch.bfloat16)
    a, b = torch.randn(2, 8).to(torch.bfloat16), torch.randn(8, 2).to(torch.bfloat16)
    merged = merge_lora(base, a, b, 0.5)
    assert merged.dtype == torch.float32
    torch.testing.assert_close(merged, base.float() + 0.5 * (b.float() @ a.float()))


def test_adapter_config_is_peft_loadable():
    from peft import LoraConfig

    _, targets = split_peft_names([f"{Q}.base_layer.weight", f"{Q}.lora_A.default.weight", f"{Q}.lora_B.default.weight"])
    config = adapter_config(LoraSettings(r=4, alpha=8, use_rslora=True, task_type="CAUSAL_LM"), targets, "s3://b/base")
    loaded = LoraConfig.from_peft_type(**config)
    assert (loaded.r, loaded.lora_alpha, loaded.use_rslora, loaded.task_type) == (4, 8, True, "CAUSAL_LM")
    assert set(loaded.target_modules) == {"q_proj"} and loaded.base_model_name_or_path == "s3://b/base"


def test_the_adapter_file_names_are_peft_s():
    from peft.utils.constants import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

    from rayexport.lora import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS

    assert ADAPTER_WEIGHTS == f"{ADAPTER_DIR}/{SAFETENSORS_WEIGHTS_NAME}"
    assert ADAPTER_CONFIG == f"{ADAPTER_DIR}/{CONFIG_NAME}"
