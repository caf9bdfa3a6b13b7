"""LoRA and remote-code checkpoints through the CLI, S3 to S3, checked against peft itself."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from support.helpers import download, reload, reload_in_fresh_process, run_main, upload
from support.models import PROMPT_IDS

pytestmark = pytest.mark.usefixtures("ray_address")


def export(src: str, dst: str, tmp_path, pool: str, *extra: str) -> str:
    """The CLI's export of `src` to `dst` with the module's warm pool, downloaded: the local folder."""
    completed = run_main("--src", src, "--dst", dst, "--workers", "2", "--dtype", "float32", "--pool", pool, *extra)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return download(dst, str(tmp_path / "export"))


def assert_weights_equal(local: str, reference: dict[str, torch.Tensor]) -> None:
    exported = load_file(f"{local}/model.safetensors")
    assert not [name for name in exported if "lora_" in name or "base_layer" in name]
    assert set(exported) == set(reference) - {"lm_head.weight"}
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def s3_lora(lora_checkpoints, s3_endpoint):
    return {name: upload(written.path, f"s3://rayexport-tests/lora/{name}") for name, written in lora_checkpoints.items()}


def test_merge_equals_peft_merge_and_unload(lora_checkpoints, s3_lora, s3_prefix, tmp_path, warm_pool):
    written = lora_checkpoints["lora"]
    local = export(s3_lora["lora"], s3_prefix, tmp_path, warm_pool)
    assert_weights_equal(local, written.reference_state)
    assert not os.path.exists(f"{local}/lora_adapter")
    reloaded = reload(local)
    torch.testing.assert_close(reloaded["logits"], written.logits, rtol=1e-5, atol=1e-5)
    assert reloaded["shared"] is True


@pytest.fixture(scope="module")
def gpt2_lora(lora_checkpoints, s3_endpoint):
    """A GPT-2 LoRA run over 3 ranks, with adapters on every Conv1D, and its S3 copy."""
    written = lora_checkpoints["gpt2_lora"]
    return written, upload(written.path, "s3://rayexport-tests/lora/gpt2")


def test_conv1d_merge_equals_peft_merge_and_unload(gpt2_lora, s3_prefix, tmp_path, warm_pool):
    """GPT-2's Conv1D LoRA is merged in the layer's own orientation, and the export's full
    verification, which recomputes each merged shard on the worker holding it, passes."""
    written, src = gpt2_lora
    local = export(src, s3_prefix, tmp_path, warm_pool, "--verify", "full")
    assert_weights_equal(local, written.reference_state)
    manifest = json.load(open(f"{local}/export_manifest.json"))
    assert manifest["verification"]["passed"] is True
    assert all(piece.get("lora") for piece in manifest["source_pieces"]["transformer.h.0.attn.c_proj.weight"])
    reloaded = reload(local)
    torch.testing.assert_close(reloaded["logits"], written.logits, rtol=1e-5, atol=1e-5)


def test_adapter_mode_writes_a_peft_adapter_on_the_base(lora_checkpoints, s3_lora, s3_prefix, tmp_path, warm_pool):
    written = lora_checkpoints["lora"]
    local = export(s3_lora["lora"], s3_prefix, tmp_path, warm_pool, "--lora", "adapter")
    config = json.load(open(f"{local}/lora_adapter/adapter_config.json"))
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (4, 8, "CAUSAL_LM")
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["use_rslora"] is False
    adapter = load_file(f"{local}/lora_adapter/adapter_model.safetensors")
    assert set(adapter) == set(written.adapter_state)
    for name, tensor in adapter.items():
        torch.testing.assert_close(tensor, written.adapter_state[name], rtol=0, atol=0)
    base = load_file(f"{local}/model.safetensors")
    merged = written.reference_state["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.allclose(base["model.layers.0.self_attn.q_proj.weight"], merged)  # the base, unmerged
    # base + adapter through peft, in a fresh process, gives the trained model's logits
    code = (
        "import json, sys, torch\n"
        "from peft import PeftModel\n"
        "from transformers import AutoModelForCausalLM\n"
        f"PROMPT_IDS = {PROMPT_IDS!r}\n"
        "model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sys.argv[1]), sys.argv[1] + '/lora_adapter').eval()\n"
        "with torch.no_grad(): print(json.dumps(model(input_ids=torch.tensor(PROMPT_IDS)).logits.tolist()))\n"
    )
    import subprocess
    import sys

    completed = subprocess.run([sys.executable, "-c", code, local], capture_output=True, text=True, check=True)
    logits = torch.tensor(json.loads(completed.stdout.strip().splitlines()[-1]))
    torch.testing.assert_close(logits, written.logits, rtol=1e-5, atol=1e-5)


def test_both_mode_writes_merged_model_and_adapter(lora_checkpoints, s3_lora, s3_prefix, tmp_path, warm_pool):
    written = lora_checkpoints["lora"]
    local = export(s3_lora["lora"], s3_prefix, tmp_path, warm_pool, "--lora", "both", "--verify", "none")
    assert_weights_equal(local, written.reference_state)
    assert set(load_file(f"{local}/lora_adapter/adapter_model.safetensors")) == set(written.adapter_state)


def test_lora_only_checkpoint_needs_and_uses_the_base_model(lora_checkpoints, s3_lora, s3_prefix, tmp_path, warm_pool):
    written = lora_checkpoints["lora_only"]
    refused = run_main("--src", s3_lora["lora_only"], "--dst", s3_prefix)
    assert refused.returncode == 1 and "--base-model" in refused.stderr
    base = upload(written.base_model, f"{s3_lora['lora_only']}-base")
    local = export(s3_lora["lora_only"], s3_prefix, tmp_path, warm_pool, "--base-model", base, "--verify", "none")
    assert_weights_equal(local, written.reference_state)
    assert os.path.exists(f"{local}/tokenizer.json")


def test_remote_code_model_is_self_contained(lora_checkpoints, s3_lora, s3_prefix, tmp_path, warm_pool):
    """The code lives only in the base model folder; the export must carry it (BRIEF 1.2) and
    reload with trust_remote_code in a fresh process with an empty module cache."""
    written = lora_checkpoints["remote"]
    base = upload(written.base_model, f"{s3_lora['remote']}-base")
    local = export(s3_lora["remote"], s3_prefix, tmp_path, warm_pool, "--base-model", base, "--trust-remote-code")
    assert {"modeling_tiny.py", "configuration_tiny.py"} <= set(os.listdir(local))
    auto_map = json.load(open(f"{local}/config.json"))["auto_map"]
    assert None not in auto_map.values() and auto_map["AutoModelForCausalLM"] == "modeling_tiny.TinyForCausalLM"
    reloaded = reload_in_fresh_process(local, trust_remote_code=True)
    torch.testing.assert_close(reloaded["logits"], written.logits, rtol=1e-5, atol=1e-5)


def test_code_missing_from_huggingface_folder_comes_from_base_model(lora_checkpoints, s3_prefix, tmp_path, warm_pool):
    """verl's FSDP2 save 'succeeds' without the modeling file: config.json names it in auto_map
    but huggingface/ lacks it."""
    written = lora_checkpoints["remote"]
    source = shutil.copytree(written.path, tmp_path / "ckpt")
    os.makedirs(source / "huggingface")
    shutil.copy(f"{written.base_model}/config.json", source / "huggingface" / "config.json")
    shutil.copy(f"{written.base_model}/configuration_tiny.py", source / "huggingface" / "configuration_tiny.py")
    src = upload(str(source), f"{s3_prefix}-src")
    base = upload(written.base_model, f"{s3_prefix}-base")
    without = run_main("--src", src, "--dst", s3_prefix, "--trust-remote-code")
    assert without.returncode == 1 and "modeling_tiny" in without.stderr
    local = export(src, s3_prefix, tmp_path, warm_pool, "--base-model", base, "--trust-remote-code", "--verify", "none")
    assert os.path.exists(f"{local}/modeling_tiny.py")
    reloaded = reload_in_fresh_process(local, trust_remote_code=True)
    torch.testing.assert_close(reloaded["logits"], written.logits, rtol=1e-5, atol=1e-5)
