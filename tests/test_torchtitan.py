"""Real torchtitan 0.3.0 checkpoints through the CLI as a user exports them.

torchtitan's own code writes them (tests/support/torchtitan_save.py, in a virtualenv of its own
from tests/support/torchtitan_env.py): its model classes, its FSDP2 helper on 2 gloo ranks, two
training steps and its `CheckpointManager` (its Trainer needs CUDA). Beside each it writes
torchtitan's own `StateDictAdapter.to_hf` of the saved weights and its model's logits. Every
exported tensor must equal `to_hf`'s, and the reloaded export compute torchtitan's logits."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from support.helpers import error_lines, exported_tensors, run_main
from support.models import PROMPT_IDS
from support.torchtitan_env import torchtitan_python
from support.virtualenvs import TORCHTITAN_CACHE

pytestmark = pytest.mark.usefixtures("ray_address")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVE_SCRIPT = os.path.join(REPO, "tests", "support", "torchtitan_save.py")
STEP = "checkpoint/step-2"

# name: (model, tying, save, dtype the save is cast to), as torchtitan_save.py takes them
CASES = {
    "llama3-untied-periodic": ("llama3", "--untied", "periodic", "float32"),  # GQA; q/k rows reordered
    "llama3-tied-final-bf16": ("llama3", "--tied", "final", "bfloat16"),
    "qwen3-tied-periodic": ("qwen3", "--tied", "periodic", "float32"),
    "qwen3_moe-untied-periodic": ("qwen3_moe", "--untied", "periodic", "float32"),
}
# torchtitan computes MoE experts in bfloat16 whatever the weights' dtype; transformers does not.
LOGITS_ATOL = {"qwen3_moe": 1e-3}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    python = torchtitan_python(TORCHTITAN_CACHE)
    root = tmp_path_factory.mktemp("torchtitan")
    folders = {}
    for name, (model, tying, save, dtype) in CASES.items():
        folders[name] = str(root / name)
        subprocess.run(
            [python, SAVE_SCRIPT, "--out", folders[name], "--model", model, tying, "--save", save, "--dtype", dtype],
            check=True, timeout=600, env={key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"},
        )
    return folders

def float32_logits(folder: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROMPT_IDS)).logits


@pytest.mark.parametrize("case", list(CASES))
def test_an_export_equals_torchtitans_own_to_hf_and_computes_its_logits(saved, case, tmp_path, warm_pool):
    model, _, save, dtype = CASES[case]
    folder, out, report_path = saved[case], str(tmp_path / "out"), tmp_path / "report.json"
    # float32 saves are published in float32 here to compare bits; the bfloat16 one is exported with
    # the default --dtype auto, which publishes bfloat16
    extra = ["--dtype", "float32"] if dtype == "float32" else []
    completed = run_main("--src", os.path.join(folder, STEP), "--dst", out, "--hf-config", os.path.join(folder, "hf"),
                         "--verify", "quick", "--report", str(report_path), "--pool", warm_pool, *extra)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["layout"] == "torchtitan"
    training_state = {key for key in report["skipped"] if ".moe.expert_bias_E" not in key}  # to_hf drops it too
    assert {key.split(".", 1)[0] for key in training_state} == (
        {"optimizer", "lr_scheduler", "dataloader", "train_state"} if save == "periodic" else set()
    )

    reference = load_file(os.path.join(folder, "reference", "to_hf.safetensors"))
    exported = exported_tensors(out)
    assert set(exported) == set(reference)  # a tied head: dropped by to_hf, and not written
    for key, tensor in reference.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    expected_logits = load_file(os.path.join(folder, "reference", "logits.safetensors"))["logits"]
    torch.testing.assert_close(float32_logits(out), expected_logits, rtol=0, atol=LOGITS_ATOL.get(model, 1e-5))


def export_workers_ever_started() -> set[str]:
    """The ids of every rayexport worker actor this session's Ray has had, ended ones included."""
    from ray._private import state

    return {actor_id for actor_id, actor in state.actors().items() if actor["ActorClassName"] == "ExportWorkerActor"}


def test_a_config_of_another_model_is_refused_before_any_worker_starts(saved, tmp_path):
    """The names are checked against the config's model from `.metadata` alone, in torchtitan's
    names: a Llama checkpoint given a Qwen3 config lacks Qwen3's q and k norms."""
    folder = saved["llama3-untied-periodic"]
    before = export_workers_ever_started()
    completed = run_main("--src", os.path.join(folder, STEP), "--dst", str(tmp_path / "out"),
                         "--hf-config", os.path.join(saved["qwen3-tied-periodic"], "hf"))
    assert completed.returncode == 1 and error_lines(completed) == [
        "rayexport: error: the checkpoint has no tensor 'layers.0.attention.q_norm.weight' that the config's model "
        "needs (and 3 more)"
    ]
    assert export_workers_ever_started() == before
    assert not os.path.exists(tmp_path / "out")
