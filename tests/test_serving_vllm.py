"""The vLLM check on real exports, with vLLM's CPU build in a virtualenv of its own (as users
keep it, named with --vllm-python): exports of FSDP2 checkpoints written by gloo ranks, of a
Megatron-Core save and of a MoE model's DeepSpeed ZeRO-3 save (head_dim 32, which vLLM's CPU
attention runs) pass it; an export missing a weight fails it, naming where
the engines part or the weight vLLM found no tensor for; a head_dim vLLM refuses is one line,
and nothing is committed."""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
from safetensors.torch import load_file, save_file

from rayexport.storage.store import Store
from rayexport.transport.manifest import MANIFEST_NAME
from rayexport.verification import VerificationError
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.serving import ServeRequest
from rayexport.verification.serving.comparison import GENERATED_TOKENS, PROMPT_LENGTHS, TOLERANCES
from rayexport.verification.serving.vllm_check import VllmServe
from support.checkpoints import VerlJob, write_format_checkpoints, write_verl_checkpoints
from support.helpers import error_lines, run_main, s3_exists
from support.models import LORA, serving_config
from support.virtualenvs import VLLM_CACHE
from support.vllm_env import vllm_python as build_vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("ray_address")]

# one naming: an export of either is the same on-disk files (test_end_to_end_formats.py), so vLLM loads the same
MOE = [("qwen3_moe", "in-memory", "verl")]
# case: (checkpoint, export options); the LoRA run's float32 training config publishes in bfloat16
CASES = {
    "tied-float32": ("qwen2-tied", {"dtype": "float32"}),
    "moe-in-memory-naming-bfloat16": (MOE[0], {"dtype": "bfloat16"}),
    "lora-merged-bfloat16-on-s3": ("lora", {}),
    # vLLM's Qwen2 takes its head size from hidden / heads, not config.json's head_dim (32 here)
    "megatron-lm-tp2-float32": ("llama-tp2-untied-megatron-lm", {"dtype": "float32"}),
    # DeepSpeed's own ZeRO-3 save, its fused experts in runs across experts and ranks
    "moe-under-zero3-bfloat16": ("zero3-bf16-qwen3-moe-world3-zero-init-serving", {}),
}


@pytest.fixture(scope="module")
def vllm_python():
    return build_vllm_python(VLLM_CACHE)


@pytest.fixture(scope="module")
def serving_checkpoints(tmp_path_factory):
    """Each checkpoint's folder: dense models and a LoRA run (verl rank files of the model as
    transformers 5 holds it), and a MoE model trained under the in-memory naming, two sets of 2 gloo ranks."""
    root = tmp_path_factory.mktemp("serving")
    jobs = {kind: VerlJob(serving_config(kind), str(root / kind)) for kind in ("qwen2-tied", "qwen2-head16")}
    jobs["lora"] = VerlJob(serving_config("qwen2-tied"), str(root / "lora"), lora=LORA)
    dense = write_verl_checkpoints(jobs)
    moe = write_format_checkpoints(str(root), MOE, config_of=serving_config)
    return {**{key: written.path for key, written in dense.items()}, **{key: written.path for key, written in moe.items()}}


@pytest.fixture(scope="module")
def exports(serving_checkpoints, megatron_checkpoints, deepspeed_checkpoints, vllm_python, tmp_path_factory, s3_endpoint,
            warm_pool):
    """Every case exported with `--serve-check vllm` through `rayexport.export()`, two at a
    time: by case, a future of (destination, report); and the vLLM check's scratch folders
    left behind (none should be). The Megatron-LM save is Megatron-Core's own (its config beside
    it), the ZeRO save DeepSpeed's own."""
    from rayexport import export
    from support.helpers import BUCKET

    megatron = megatron_checkpoints["llama-tp2-untied-megatron-lm"]
    sources = {**{name: (folder, {}) for name, folder in serving_checkpoints.items()},
               "llama-tp2-untied-megatron-lm": (megatron, {"hf_config": os.path.join(megatron, "hf")})}
    zero = "zero3-bf16-qwen3-moe-world3-zero-init-serving"
    sources[zero] = (os.path.join(deepspeed_checkpoints[zero], "checkpoint-2"), {})

    root = tmp_path_factory.mktemp("serving-exports")
    scratch = os.path.join(tempfile.gettempdir(), "rayexport-vllm-*")
    before = set(glob.glob(scratch))

    def run(case):
        checkpoint, options = CASES[case]
        source, source_options = sources[checkpoint]
        destination = f"s3://{BUCKET}/serving/{case}" if case.endswith("on-s3") else str(root / case)
        report = export(source, destination, workers=2, log_level="WARNING", serve_check="vllm", pool=warm_pool,
                        vllm_python=vllm_python, **source_options, **options)
        return destination, json.loads(report.to_json())

    with ThreadPoolExecutor(2) as pool:
        futures = {case: pool.submit(run, case) for case in CASES}
        wait(futures.values())
    return futures, set(glob.glob(scratch)) - before


@pytest.mark.parametrize("case", CASES)
def test_each_export_loads_in_vllm_and_its_tokens_are_transformers_top_choices(case, exports):
    destination, report = exports[0][case].result()
    served = report["verification"]["checks"]["vllm"]
    dtype = "float32" if case.endswith("float32") else "bfloat16"
    assert report["verification"]["passed"] and report["dtype"] == dtype
    assert (served["engine"], served["version"], served["device"], served["dtype"]) == ("vllm", "0.32.0", "cpu", dtype)
    assert (served["prompts"], served["tokens_compared"]) == (len(PROMPT_LENGTHS), len(PROMPT_LENGTHS) * GENERATED_TOKENS)
    assert served["largest_logprob_difference"] <= TOLERANCES[dtype].logprob
    assert served["largest_below_top"] <= TOLERANCES[dtype].top
    assert served["load_s"] > 0 and served["generate_s"] > 0
    manifest = f"{destination}/{MANIFEST_NAME}"
    assert s3_exists(manifest) if destination.startswith("s3://") else os.path.exists(manifest)


def test_a_remote_export_is_staged_for_the_check_and_removed_after(exports):
    destination, report = exports[0]["lora-merged-bfloat16-on-s3"].result()
    assert destination.startswith("s3://") and "vllm" in report["verification"]["checks"]
    assert exports[1] == set()


def test_an_export_missing_a_weight_fails_naming_where_vllm_and_transformers_part(exports, vllm_python, tmp_path):
    """vLLM 0.32 loads a folder without a linear layer's weight without a word; the check names
    the prompt and position where the two engines' tokens part. A missing norm weight vLLM does
    report: the check names it."""
    source, _ = exports[0]["tied-float32"].result()
    folders = {}
    for removed in ("model.layers.0.mlp.down_proj.weight", "model.norm.weight"):
        folders[removed] = shutil.copytree(source, tmp_path / removed, ignore=shutil.ignore_patterns(MANIFEST_NAME))
        tensors = load_file(folders[removed] / "model.safetensors")
        del tensors[removed]
        save_file(tensors, folders[removed] / "model.safetensors", metadata={"format": "pt"})
    expected = ExpectedExport(files={}, tensors={}, serve=ServeRequest(python=vllm_python))

    def check(removed):
        with pytest.raises(VerificationError) as raised:
            VllmServe().run(Store(str(folders[removed])), expected, 600, 0)
        return str(raised.value)

    with ThreadPoolExecutor(2) as pool:
        linear, norm = pool.map(check, folders)
    assert linear.startswith("vllm: prompt 0 (token ids ") and ", generated position " in linear
    assert "vLLM generated token" in linear and "the two engines part there (float32 allows 0.001)" in linear
    assert norm == "vllm: vLLM 0.32.0 found no tensor in the export for its weight 'model.norm.weight'"


def test_a_head_size_vllm_does_not_run_is_one_line_and_nothing_is_committed(serving_checkpoints, vllm_python, tmp_path):
    destination = tmp_path / "export"
    completed = run_main("--src", serving_checkpoints["qwen2-head16"], "--dst", str(destination), "--workers", "2",
                         "--serve-check", "vllm", "--vllm-python", vllm_python)
    assert completed.returncode == 1
    lines = error_lines(completed)
    assert len(lines) == 1 and lines[0].startswith("rayexport: error: vllm: vLLM 0.32.0 cannot run the export's model: ")
    assert "head_dim=16" in lines[0] and lines[0].endswith("; the export was not committed")
    assert not (destination / MANIFEST_NAME).exists()


def test_the_verify_command_runs_the_check_it_is_asked_for(exports, capsys):
    """`python -m rayexport.verify --serve-check vllm` on a committed export: with a Python that
    has no vLLM (this one), the one line naming it."""
    import sys

    from rayexport.verify import main

    destination, _ = exports[0]["tied-float32"].result()
    assert main([destination, "--serve-check", "vllm", "--vllm-python", sys.executable]) == 1
    assert capsys.readouterr().err.strip() == (
        f"rayexport: error: vllm: no vLLM in {sys.executable} (ModuleNotFoundError: No module named 'vllm'); name a "
        "Python that has it with --vllm-python"
    )
