"""rayexport.model.description: which files of a Hugging Face folder an export carries, where the folder
comes from, which class builds the model, and the config.json the export writes."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from rayexport.common.errors import ExportError
from rayexport.model.description import (
    ModelClass,
    build_meta_model,
    exported_config,
    hf_file_names,
    hf_folder,
    kept_in_float32,
    model_class,
)
from rayexport.storage.store import Store
from support.helpers import folder_with
from support.models import remote_code_config, tiny_config, tiny_format_config


# --- hf_file_names -------------------------------------------------------------------------------


def test_the_carried_files_are_everything_but_weights(tmp_path):
    store = folder_with(tmp_path, {
        "config.json": "{}", "tokenizer.json": "{}", "generation_config.json": "{}", "modeling_tiny.py": "",
        "assets/notes.md": "", "model-00001-of-00002.safetensors": "", "model.safetensors.index.json": "{}",
        "pytorch_model.bin": "", "pytorch_model.bin.index.json": "{}", "optimizer.pt": "", "rng.pth": "",
        "original/consolidated.ckpt": "",
    })
    assert hf_file_names(store) == [
        "assets/notes.md", "config.json", "generation_config.json", "modeling_tiny.py", "tokenizer.json",
    ]


# --- hf_folder -----------------------------------------------------------------------------------


def test_the_checkpoints_own_hf_folder_comes_first(tmp_path):
    own = folder_with(tmp_path / "ckpt" / "huggingface", {"config.json": "{}"})
    given = folder_with(tmp_path / "given", {"config.json": "{}"})
    assert hf_folder(own, given, None, None) is own


def test_without_its_own_config_the_first_folder_given_is_used(tmp_path):
    own = Store(str(tmp_path / "ckpt" / "huggingface"))
    nearby = folder_with(tmp_path / "nearby", {"config.json": "{}"})
    base = folder_with(tmp_path / "base", {"config.json": "{}"})
    assert hf_folder(own, None, nearby, base) is nearby
    assert hf_folder(None, None, None, base) is base


def test_a_given_folder_without_config_is_named(tmp_path):
    own = Store(str(tmp_path / "ckpt" / "huggingface"))
    given = folder_with(tmp_path / "given", {"tokenizer.json": "{}"})
    with pytest.raises(ExportError) as error:
        hf_folder(own, given, None, None)
    assert str(error.value) == f"missing '{tmp_path}/given/config.json'"


def test_no_config_anywhere_names_the_checkpoints_and_the_flags(tmp_path):
    own = Store(str(tmp_path / "ckpt" / "huggingface"))
    with pytest.raises(ExportError) as error:
        hf_folder(own, None, None, None)
    message = str(error.value)
    assert message.startswith(f"missing '{tmp_path}/ckpt/huggingface/config.json'")
    assert "--hf-config" in message and "--base-model" in message


# --- model_class ---------------------------------------------------------------------------------


def test_a_transformers_architecture_is_built_from_its_class():
    config = tiny_config("llama-untied")
    assert model_class(config) == ModelClass("LlamaForCausalLM", auto_class=False)
    assert type(build_meta_model(config, False)).__name__ == "LlamaForCausalLM"


def test_remote_code_is_built_through_the_auto_class_its_auto_map_names(tmp_path):
    config = remote_code_config(str(tmp_path / "remote"))
    assert model_class(config) == ModelClass("AutoModelForCausalLM", auto_class=True)
    model = build_meta_model(config, True)
    assert type(model).__name__ == "TinyForCausalLM"
    assert next(model.parameters()).device.type == "meta"  # names and shapes, no memory


def test_an_unknown_architecture_is_refused_by_name():
    config = tiny_config("qwen2-tied")
    config.architectures = ["NoSuchModelForCausalLM"]
    with pytest.raises(ExportError, match="^architecture 'NoSuchModelForCausalLM' in config.json is not a transformers class$"):
        model_class(config)


def test_a_config_naming_no_architecture_is_refused():
    config = tiny_config("qwen2-tied")
    config.architectures = None
    with pytest.raises(ExportError, match="names no architectures"):
        model_class(config)


# --- exported_config -----------------------------------------------------------------------------


def test_the_exported_config_states_the_written_dtype_once():
    config = {"model_type": "x", "dtype": "float32", "torch_dtype": "float32",
              "vision_config": {"model_type": "x_vision", "dtype": "float32", "depth": 2},
              "rope_scaling": {"type": "mrope", "dtype": "kept: not a sub-config"}}
    original = copy.deepcopy(config)
    exported = exported_config(config, "bfloat16")
    assert exported["dtype"] == exported["torch_dtype"] == "bfloat16"
    assert exported["vision_config"] == {"model_type": "x_vision", "depth": 2}
    assert exported["rope_scaling"] == original["rope_scaling"]
    assert config == original  # the caller's config is left as it was


def test_no_dtype_leaves_the_declared_one_and_adds_none():
    exported = exported_config({"model_type": "x", "dtype": "float32"}, None)
    assert exported == {"model_type": "x", "dtype": "float32"}
    assert "torch_dtype" not in exported_config({"model_type": "x"}, "float16")


def test_auto_map_entries_transformers_would_reject_are_dropped():
    exported = exported_config({"auto_map": {"AutoConfig": "c.C", "AutoModelForSequenceClassification": None}}, None)
    assert exported["auto_map"] == {"AutoConfig": "c.C"}


def test_an_untied_export_of_a_vlm_loads_untied_in_the_written_dtype(tmp_path):
    """Qwen2.5-VL declares its tie only in text_config: both places are untied, and
    transformers reads the result back as an untied bfloat16 model."""
    from transformers import AutoConfig

    saved = tiny_format_config("qwen2_5_vl").to_diff_dict()
    assert saved["text_config"]["tie_word_embeddings"] is True
    exported = exported_config(saved, "bfloat16", untie=True)
    assert exported["tie_word_embeddings"] is False and exported["text_config"]["tie_word_embeddings"] is False
    (tmp_path / "config.json").write_text(json.dumps(exported))
    loaded = AutoConfig.from_pretrained(str(tmp_path))
    assert loaded.get_text_config().tie_word_embeddings is False
    assert loaded.dtype == torch.bfloat16
    assert exported_config(saved, "bfloat16")["text_config"]["tie_word_embeddings"] is True  # tied unless asked


def test_a_folder_described_before_is_described_again_from_memory_until_a_file_changes(tmp_path, monkeypatch):
    """Exports of later checkpoints of one model (a watcher, export_remote after each save)
    skip building the meta model again; any changed byte of the folder builds it afresh."""
    import rayexport.model.description as model

    from support.models import write_hf_folder

    folder = tmp_path / "hf"
    write_hf_folder(tiny_config("qwen2-tied"), str(folder))
    builds = []
    monkeypatch.setattr(model, "_DESCRIBED", {})  # what earlier tests in this process described
    monkeypatch.setenv("RAYEXPORT_CACHE", "")  # nor what they saved (test_model_saved.py)
    monkeypatch.setattr(model, "build_meta_model", lambda *args: builds.append(args) or build_meta_model(*args))
    first = model.describe_model(Store(str(folder)), None, False)
    again = model.describe_model(Store(str(folder)), None, False)
    assert again is first and len(builds) == 1
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 17}))
    changed = model.describe_model(Store(str(folder)), None, False)
    assert len(builds) == 2 and changed.carried["tokenizer_config.json"] == b'{"model_max_length": 17}'
    assert changed.formats == first.formats


def test_deepseek_v3s_router_is_what_transformers_loads_in_float32():
    model = build_meta_model(tiny_format_config("deepseek_v3"), False)  # its layer 1 is the MoE one
    router = {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"}
    assert kept_in_float32(model, set(model.state_dict())) == {"bfloat16": router, "float16": router}
    assert kept_in_float32(build_meta_model(tiny_config(), False), set()) == {}
