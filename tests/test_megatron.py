"""Real Megatron-Core torch_dist checkpoints through the CLI and `export_remote`, as a user
exports them.

Megatron-Core's own code writes them (tests/support/megatron_save.py, in a virtualenv of its own
from tests/support/megatron_env.py): its GPTModel on gloo CPU ranks with tensor, pipeline and
expert parallelism, a few training steps and `dist_checkpointing.save`, laid out as verl's
Megatron backend or Megatron-LM saves. Beside each it writes mbridge's own Hugging Face export
of the live model (verl's Megatron<->HF bridge) and Megatron's logits. Every exported tensor must
equal mbridge's, and the reloaded export compute Megatron's logits.

Qwen2.5-VL cannot be built by Megatron-Core on CPU (docs/layouts.md says why): its case
(support/megatron_vlm.py) is a tiny Hugging Face model put through mbridge's own conversion
tables, saved in Megatron-Core's names, and must come back equal to mbridge's export, with the
image processor, computing the model's text logits and image features."""

from __future__ import annotations

import json
import os

import pytest
import ray
import torch
from safetensors.torch import load_file

from rayexport import export_remote
from support.helpers import download, error_lines, exported_tensors, run_main, upload
from support.megatron_checkpoints import CASES, VLM_CASE, source_of
from support.models import PROMPT_IDS

pytestmark = pytest.mark.usefixtures("ray_address")

# megatron_save.py's logits come from a float32 model of the saved weights, as the reload's do.
LOGITS_ATOL = 1e-5

def assert_equals_mbridge_and_megatrons_logits(folder: str, out: str) -> None:
    from transformers import AutoModelForCausalLM

    reference = load_file(os.path.join(folder, "reference", "mbridge.safetensors"))
    exported = exported_tensors(out)
    assert set(exported) == set(reference)  # a tied head: mbridge leaves it out, and so does the export
    for key, tensor in reference.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT_IDS)).logits
    expected = load_file(os.path.join(folder, "reference", "logits.safetensors"))["logits"]
    torch.testing.assert_close(logits, expected, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("case", list(CASES))
def test_an_export_equals_mbridges_and_computes_megatrons_logits(megatron_checkpoints, case, tmp_path, warm_pool):
    folder, out, report_path = megatron_checkpoints[case], str(tmp_path / "out"), tmp_path / "report.json"
    source, extra = source_of(folder)
    # float32 saves are published in float32 here to compare bits; bfloat16 ones with --dtype auto
    if "bfloat16" not in CASES[case]:
        extra += ["--dtype", "float32"]
    completed = run_main("--src", source, "--dst", out, "--verify", "full", "--report", str(report_path), "--pool", warm_pool, *extra)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["layout"] == "megatron" and report["verification"]["level"] == "full"
    assert any("_extra_state" in key for key in report["skipped"])
    if "--optimizer" in CASES[case]:  # the distributed optimizer's state
        assert any(".optimizer.distributed." in key for key in report["skipped"])
    # DeepSeek-V3's float32 expert bias stays float32 (as mbridge's is), and the config says bfloat16
    written = json.loads((tmp_path / "out" / "config.json").read_text())["dtype"]
    assert written == ("bfloat16" if "bfloat16" in CASES[case] else "float32")
    assert_equals_mbridge_and_megatrons_logits(folder, out)


def assert_equals_mbridge_and_the_vision_language_models_outputs(folder: str, out: str) -> None:
    from transformers import AutoModelForImageTextToText

    from support.megatron_vlm import outputs

    reference = load_file(os.path.join(folder, "reference", "mbridge.safetensors"))
    exported = exported_tensors(out)
    assert set(exported) == set(reference) and any(key.startswith("visual.blocks.") for key in reference)
    for key, tensor in reference.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    assert os.path.exists(os.path.join(out, "preprocessor_config.json"))
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    expected = load_file(os.path.join(folder, "reference", "outputs.safetensors"))
    for name, computed in outputs(model).items():
        torch.testing.assert_close(computed, expected[name], rtol=0, atol=LOGITS_ATOL, msg=name)


def test_a_vision_language_model_exports_both_towers_and_its_processor(megatron_checkpoints, tmp_path, warm_pool):
    folder, out, report_path = megatron_checkpoints[VLM_CASE], str(tmp_path / "out"), tmp_path / "report.json"
    source, extra = source_of(folder)
    completed = run_main("--src", source, "--dst", out, "--verify", "full", "--report", str(report_path),
                         "--pool", warm_pool, "--dtype", "float32", *extra)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["layout"] == "megatron" and report["verification"]["passed"]
    assert_equals_mbridge_and_the_vision_language_models_outputs(folder, out)


# each case with the check of what it must compute (tests/test_megatron_bridge.py exports more
# kinds of save through export_remote)
REMOTE_CASES = {
    VLM_CASE: assert_equals_mbridge_and_the_vision_language_models_outputs,
}


@pytest.mark.parametrize("case", list(REMOTE_CASES))
def test_export_remote_from_s3_to_s3(megatron_checkpoints, case, s3_prefix, tmp_path, warm_pool):
    """As an RL trainer exports each checkpoint: from inside its Ray program, S3 to S3."""
    folder = megatron_checkpoints[case]
    source = upload(os.path.join(folder, "actor"), f"{s3_prefix}/actor")
    dtype = "auto" if "bfloat16" in CASES.get(case, ()) else "float32"  # as the CLI test publishes each
    report = ray.get(export_remote(source, f"{s3_prefix}/export", workers=2, dtype=dtype, pool=warm_pool), timeout=600)
    assert report.verification["passed"]
    REMOTE_CASES[case](folder, download(f"{s3_prefix}/export", str(tmp_path / "out")))


def export_workers_ever_started() -> set[str]:
    """The ids of every rayexport worker actor this session's Ray has had, ended ones included."""
    from ray._private import state

    return {actor_id for actor_id, actor in state.actors().items() if actor["ActorClassName"] == "ExportWorkerActor"}


def test_a_config_that_does_not_fit_the_saved_shapes_is_refused_before_any_worker_starts(megatron_checkpoints, tmp_path):
    """The Llama save's linear_qkv holds 2 query groups (2 q heads, a k and a v head each); a
    config of 1 query group cannot place q, k and v, and says so from `.metadata` alone."""
    folder = megatron_checkpoints["llama-tp2-untied-megatron-lm"]
    config = json.loads(open(os.path.join(folder, "hf", "config.json")).read())
    other = tmp_path / "hf"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(dict(config, num_key_value_heads=1)))
    before = export_workers_ever_started()
    completed = run_main("--src", folder, "--dst", str(tmp_path / "out"), "--hf-config", str(other))
    lines = error_lines(completed)
    assert completed.returncode == 1 and len(lines) == 1
    assert "Megatron-Core tensor 'decoder.layers.self_attention.linear_qkv.weight' has shape" in lines[0]
    assert lines[0].endswith("check --hf-config")
    assert export_workers_ever_started() == before
    assert not os.path.exists(tmp_path / "out")
