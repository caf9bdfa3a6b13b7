"""Real DeepSpeed ZeRO checkpoints through the CLI and `export_remote`, as a user exports them.

DeepSpeed's own engine writes them (tests/support/deepspeed_save.py, in a virtualenv of its own
from tests/support/deepspeed_env.py): a transformers Llama of odd sizes on gloo CPU ranks, ZeRO
stages 1, 2 and 3, a few training steps and `engine.save_checkpoint`, laid out as transformers'
Trainer or OpenRLHF saves. Beside each it writes DeepSpeed's own conversion,
`get_fp32_state_dict_from_zero_checkpoint`: every exported tensor must be that, cast to the
export's dtype. Nothing of DeepSpeed is imported here."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import ray
import torch
from safetensors.torch import load_file

from rayexport import export_remote
from support.deepspeed_checkpoints import CASES, source_of
from support.helpers import download, error_lines, exported_tensors, run_main, upload

pytestmark = pytest.mark.usefixtures("ray_address")

LORA_SCALE = 8 / 4  # the writer's lora_alpha / r


def zero_to_fp32(folder: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "reference", "zero_to_fp32.safetensors"))


def export(folder: str, out: str, *extra: str) -> dict:
    source, options = source_of(folder)
    report = os.path.join(os.path.dirname(out), "report.json")
    completed = run_main("--src", source, "--dst", out, "--verify", "full", "--report", report, *options, *extra)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(open(report).read())


@pytest.mark.parametrize("case", [case for case in CASES if "lora" not in case])
def test_an_export_is_deepspeeds_own_conversion_in_the_published_dtype(deepspeed_checkpoints, case, tmp_path):
    folder, out = deepspeed_checkpoints[case], str(tmp_path / "out")
    report = export(folder, out)
    assert report["layout"].startswith("deepspeed-zero") and report["verification"]["level"] == "full"
    reference, exported = zero_to_fp32(folder), exported_tensors(out)
    assert set(exported) == set(reference)  # a tied head: saved once, by both
    for name, tensor in reference.items():  # fp32 masters, published in bfloat16 (--dtype auto)
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    config = json.loads(open(os.path.join(out, "config.json")).read())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] == ("--tied" in CASES[case])
    assert not {"latest", "zero_to_fp32.py", "trainer_state.json"} & set(os.listdir(out))  # DeepSpeed's, not the model's


def test_lora_under_zero2_is_merged_into_its_frozen_base(deepspeed_checkpoints, tmp_path):
    """The base weights are frozen parameters (kept whole in the model states), the adapters trained."""
    folder, out = deepspeed_checkpoints["zero2-lora"], str(tmp_path / "out")
    export(folder, out, "--lora-alpha", "8", "--dtype", "float32")
    reference, exported = zero_to_fp32(folder), exported_tensors(out)
    prefix = "base_model.model."
    for name, tensor in exported.items():
        module = name.removesuffix(".weight")
        base = reference.get(f"{prefix}{module}.base_layer.weight")
        if base is None:
            assert torch.equal(tensor, reference[prefix + name]), name
            continue
        a, b = reference[f"{prefix}{module}.lora_A.default.weight"], reference[f"{prefix}{module}.lora_B.default.weight"]
        torch.testing.assert_close(tensor, base + LORA_SCALE * b @ a, rtol=0, atol=1e-6)


def test_lora_under_zero3_is_kept_as_an_adapter(deepspeed_checkpoints, tmp_path):
    """ZeRO-3 partitions the frozen base too; it is written beside its adapter (a merge into it is refused)."""
    folder, out = deepspeed_checkpoints["zero3-lora"], str(tmp_path / "out")
    refused = run_main("--src", source_of(folder)[0], "--dst", str(tmp_path / "merged"), "--lora-alpha", "8")
    assert refused.returncode == 1 and "export with --lora adapter" in error_lines(refused)[0]
    export(folder, out, "--lora-alpha", "8", "--lora", "adapter", "--dtype", "float32")
    reference, exported = zero_to_fp32(folder), exported_tensors(out)
    adapter = load_file(os.path.join(out, "lora_adapter", "adapter_model.safetensors"))
    for name, tensor in reference.items():
        if ".lora_" in name:
            assert torch.equal(adapter[name.replace(".default", "")], tensor), name
        else:
            assert torch.equal(exported[name.removeprefix("base_model.model.").replace(".base_layer", "")], tensor), name


def test_export_remote_from_s3_to_s3(deepspeed_checkpoints, s3_prefix, tmp_path):
    """As an RL trainer exports each checkpoint: from inside its Ray program, S3 to S3."""
    folder = deepspeed_checkpoints["zero3-bf16-tied-zero-init"]
    source = upload(os.path.join(folder, "checkpoint-2"), f"{s3_prefix}/checkpoint-2")
    report = ray.get(export_remote(source, f"{s3_prefix}/export", workers=2), timeout=600)
    assert report.verification["passed"]
    exported = exported_tensors(download(f"{s3_prefix}/export", str(tmp_path / "out")))
    for name, tensor in zero_to_fp32(folder).items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name


def copy_of(folder: str, tmp_path) -> str:
    copy = str(tmp_path / "save")
    shutil.copytree(os.path.join(folder, "checkpoint-2"), copy)
    return copy


@pytest.mark.parametrize("change,message", [
    (lambda tag: os.remove(os.path.join(tag, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")),
     "has no optimizer states file of rank 1 (of world size 2)"),
    (lambda tag: [os.remove(os.path.join(tag, name)) for name in os.listdir(tag) if "optim_states" in name],
     "has no optimizer states files: a ZeRO-3 save's weights are only there"),
    (lambda tag: shutil.copy(os.path.join(tag, "zero_pp_rank_0_mp_rank_00_model_states.pt"),
                             os.path.join(tag, "zero_pp_rank_0_mp_rank_01_model_states.pt")),
     "is a pipeline or tensor parallel DeepSpeed save"),
])
def test_a_save_rayexport_cannot_read_is_one_line_before_any_worker_starts(deepspeed_checkpoints, tmp_path, change, message):
    save = copy_of(deepspeed_checkpoints["zero3-bf16-tied-zero-init"], tmp_path)
    change(os.path.join(save, "global_step2"))
    completed = run_main("--src", save, "--dst", str(tmp_path / "out"))
    lines = error_lines(completed)
    assert completed.returncode == 1 and len(lines) == 1 and message in lines[0], completed.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")


def test_a_pickle_naming_another_class_is_refused_by_name(deepspeed_checkpoints, tmp_path):
    """The files are never `torch.load`ed: their records are unpickled from an allow-list."""
    save = copy_of(deepspeed_checkpoints["zero2-tied-two-groups"], tmp_path)
    path = os.path.join(save, "global_step2", "mp_rank_00_model_states.pt")
    record = {"param_shapes": [{"w": torch.Size([2])}], "dp_world_size": 1, "payload": sys.exit}
    torch.save(record, path)
    completed = run_main("--src", save, "--dst", str(tmp_path / "out"))
    lines = error_lines(completed)
    assert completed.returncode == 1 and len(lines) == 1
    assert "refers to 'sys.exit', which rayexport does not unpickle" in lines[0]
