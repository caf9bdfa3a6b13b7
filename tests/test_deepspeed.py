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
from support.deepspeed_checkpoints import CASES, MOE_CASES, source_of
from support.helpers import download, error_lines, exported_tensors, run_main, upload

pytestmark = pytest.mark.usefixtures("ray_address")

LORA_SCALE = 8 / 4  # the writer's lora_alpha / r
PROMPT_IDS = [[3, 14, 15, 92, 65, 35, 89, 79]]


def zero_to_fp32(folder: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "reference", "zero_to_fp32.safetensors"))


def save_pretrained(folder: str) -> str:
    """The folder `save_pretrained` wrote DeepSpeed's own conversion to: the model's on-disk format."""
    return os.path.join(folder, "reference", "save_pretrained")


def logits(folder: str, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor(PROMPT_IDS)).logits


def copy_of(folder: str, tmp_path) -> str:
    copy = str(tmp_path / "save")
    shutil.copytree(os.path.join(folder, "checkpoint-2"), copy)
    return copy


def published_dtype(case: str) -> torch.dtype:
    """What `--dtype auto` publishes fp32 masters in: float16 for a float16 run (its config says
    so), bfloat16 otherwise."""
    return torch.float16 if "float16" in CASES[case] else torch.bfloat16


def export(folder: str, out: str, pool: str, *extra: str) -> dict:
    """The CLI's export of a saved case, verified in full, with the module's warm pool; its report."""
    source, options = source_of(folder)
    report = os.path.join(os.path.dirname(out), "report.json")
    completed = run_main("--src", source, "--dst", out, "--verify", "full", "--report", report, "--pool", pool, *options, *extra)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(open(report).read())


@pytest.mark.parametrize("case", [case for case in CASES if "lora" not in case])
def test_an_export_is_deepspeeds_own_conversion_saved_by_transformers_in_the_published_dtype(deepspeed_checkpoints, case, tmp_path,
                                                                                            warm_pool):
    """A MoE model's fused experts, which ZeRO flattened into runs across experts and ranks, are
    exported per expert, as `save_pretrained` writes them."""
    folder, out = deepspeed_checkpoints[case], str(tmp_path / "out")
    report = export(folder, out, warm_pool)
    assert report["layout"].startswith("deepspeed-zero") and report["verification"]["level"] == "full"
    reference, exported = exported_tensors(save_pretrained(folder)), exported_tensors(out)
    assert set(exported) == set(reference)  # a tied head: saved once, by both
    published = published_dtype(case)
    for name, tensor in reference.items():
        assert exported[name].dtype == published and torch.equal(exported[name], tensor.to(published)), name
    if case in MOE_CASES:
        assert any(".experts.4." in name for name in exported) and not any("gate_up_proj" in name for name in exported)
    config = json.loads(open(os.path.join(out, "config.json")).read())
    assert config["dtype"] == str(published)[6:] and config["tie_word_embeddings"] == ("--tied" in CASES[case])
    assert not {"latest", "zero_to_fp32.py", "trainer_state.json"} & set(os.listdir(out))  # DeepSpeed's, not the model's
    assert torch.equal(logits(out, published), logits(save_pretrained(folder), published))


def test_a_zero1_save_without_optimizer_states_exports_its_16_bit_weights_and_says_so(deepspeed_checkpoints, tmp_path, caplog,
                                                                                    warm_pool):
    """The model states hold the float16 weights DeepSpeed copied from its fp32 masters after the
    last step (views of one flat buffer): the export is the masters cast to float16, and its log says where it came from."""
    save = copy_of(deepspeed_checkpoints["zero1-fp16-untied"], tmp_path)
    tag = os.path.join(save, "global_step2")
    for name in os.listdir(tag):
        if "optim_states" in name:
            os.remove(os.path.join(tag, name))
    out = str(tmp_path / "out")
    completed = run_main("--src", save, "--dst", out, "--verify", "full", "--report", str(tmp_path / "report.json"), "--pool", warm_pool)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert f"no optimizer states in {tag}: exporting the 16-bit weights of mp_rank_00_model_states.pt" in caplog.text
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["layout"] == "deepspeed-16bit" and report["verification"]["level"] == "full"
    exported = exported_tensors(out)
    reference = zero_to_fp32(deepspeed_checkpoints["zero1-fp16-untied"])
    assert set(exported) == set(reference)
    for name, tensor in reference.items():
        assert exported[name].dtype == torch.float16 and torch.equal(exported[name], tensor.half()), name


@pytest.mark.parametrize("case,mode", [("zero2-lora", "merge"), ("zero3-lora", "both")])
def test_lora_under_zero_is_merged_into_its_frozen_base(deepspeed_checkpoints, tmp_path, case, mode, warm_pool):
    """The base weights are frozen parameters: kept whole in the model states under ZeRO-2,
    partitioned like the rest under ZeRO-3 (each rank merges its runs of them); the adapters trained.
    `--lora both` also writes the adapter, as trained."""
    folder, out = deepspeed_checkpoints[case], str(tmp_path / "out")
    export(folder, out, warm_pool, "--lora-alpha", "8", "--dtype", "float32", "--lora", mode)
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
    if mode == "both":
        adapter = load_file(os.path.join(out, "lora_adapter", "adapter_model.safetensors"))
        trained = {name.replace(".default", ""): tensor for name, tensor in reference.items() if ".lora_" in name}
        assert set(adapter) == set(trained) and all(torch.equal(adapter[name], trained[name]) for name in trained)


@pytest.mark.parametrize("case", ["zero3-bf16-tied-zero-init", "zero2-bf16-mixtral-world3-tied"])
def test_export_remote_from_s3_to_s3(deepspeed_checkpoints, case, s3_prefix, tmp_path, warm_pool):
    """As an RL trainer exports each checkpoint: from inside its Ray program, S3 to S3."""
    folder = deepspeed_checkpoints[case]
    source = upload(os.path.join(folder, "checkpoint-2"), f"{s3_prefix}/{case}")
    report = ray.get(export_remote(source, f"{s3_prefix}/{case}-export", workers=2, pool=warm_pool, verify="full"), timeout=600)
    assert report.verification["passed"] and report.verification["level"] == "full"
    exported = exported_tensors(download(f"{s3_prefix}/{case}-export", str(tmp_path / "out")))
    reference = exported_tensors(save_pretrained(folder))
    assert set(exported) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name


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
