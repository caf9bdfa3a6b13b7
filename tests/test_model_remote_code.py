"""Remote code: auto_map files, and bundling from the base model, never a PEFT wrapper (BRIEF 1.2)."""

from __future__ import annotations

import os

import pytest
import torch

from rayexport.model.remote_code import auto_map_files, bundle_model_code, unwrap_peft
from support.models import LORA, REMOTE_AUTO_MAP, remote_code_config


def test_auto_map_files_covers_repo_prefixes_lists_and_none():
    auto_map = {
        "AutoConfig": "configuration_tiny.TinyConfig",
        "AutoModel": "org/repo--modeling_tiny.TinyModel",
        "AutoTokenizer": ["tokenization_tiny.TinyTokenizer", None],
        "AutoModelForSequenceClassification": None,
    }
    assert auto_map_files({"auto_map": auto_map}) == [
        "configuration_tiny.py", "modeling_tiny.py", "tokenization_tiny.py",
    ]
    assert auto_map_files({}) == []


@pytest.fixture
def peft_wrapped_remote_model(tmp_path):
    """A LoRA PeftModel around a tiny trust_remote_code model, as a trainer holds it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = remote_code_config(str(tmp_path / "code"))
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    return get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA))


def test_bundling_receives_the_base_model_not_the_peft_wrapper(peft_wrapped_remote_model, tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic_module_utils

    received = []
    original = dynamic_module_utils.custom_object_save

    def spy(obj, folder, config=None):
        received.append(obj)
        return original(obj, folder, config=config)

    monkeypatch.setattr(dynamic_module_utils, "custom_object_save", spy)
    out = tmp_path / "export"
    out.mkdir()
    files = bundle_model_code(peft_wrapped_remote_model, str(out))
    assert received == [peft_wrapped_remote_model.get_base_model()]
    assert type(received[0]).__name__ == "TinyForCausalLM"
    # the modeling file auto_map points to, and the configuration file it imports relatively
    assert files == ["configuration_tiny.py", "modeling_tiny.py"]
    assert set(os.listdir(out)) == {"configuration_tiny.py", "modeling_tiny.py"}
    assert set(auto_map_files({"auto_map": REMOTE_AUTO_MAP})) == set(files)


def test_unwrap_leaves_plain_models_alone(peft_wrapped_remote_model):
    base = peft_wrapped_remote_model.get_base_model()
    assert unwrap_peft(peft_wrapped_remote_model) is base
    assert unwrap_peft(base) is base
