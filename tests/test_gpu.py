"""The NCCL path on a real GPU (`pytest -m gpu`; skipped where torch finds no CUDA device, as
on the CI machines). benchmarks/gpu_check.sh runs the same path on a GPU machine without Ray.

One GPU runs one NCCL worker (NCCL refuses two ranks on one device); the number of workers
is taken from the GPUs found, so a machine with two or more also gathers over NCCL."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from rayexport.plan.schedule import WINDOW
from rayexport.transport.gather import Staging

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MiB = 2**20


def export_cli(source, destination, *options: str) -> dict:
    """`python -m rayexport.run` as a user runs it, on its own local Ray (which finds the GPUs);
    returns the report."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    report = f"{destination}.report.json"
    completed = subprocess.run(
        [sys.executable, "-m", "rayexport.run", "--src", str(source), "--dst", str(destination),
         "--report", report, *options],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    with open(report) as handle:
        return json.load(handle)


def weight_digests(folder) -> dict[str, str]:
    return {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
        for name in sorted(os.listdir(folder)) if name.endswith((".safetensors", ".index.json"))
    }


def test_an_nccl_export_through_the_cli_is_verified_and_equals_the_gloo_export(checkpoints, tmp_path):
    workers = str(min(torch.cuda.device_count(), checkpoints["tied"].world_size))
    common = ("--workers", workers, "--bucket-size", "64KiB", "--verify", "full")
    gloo = export_cli(checkpoints["tied"].path, tmp_path / "gloo", "--backend", "gloo", *common)
    nccl = export_cli(checkpoints["tied"].path, tmp_path / "nccl", "--backend", "nccl", *common)
    assert gloo["backend"] == "gloo" and nccl["backend"] == "nccl"
    assert nccl["workers"] == int(workers)
    # each actor sees only its own GPU, as cuda:0
    assert {where["device"] for where in nccl["placement"].values()} == {"cuda:0"}
    assert nccl["verification"]["passed"] is True and nccl["verification"]["level"] == "full"
    assert weight_digests(tmp_path / "nccl") == weight_digests(tmp_path / "gloo")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a gather over NCCL needs two GPUs")
def test_the_nccl_gather_holds_at_most_the_window_on_each_gpu(tmp_path):
    from safetensors import safe_open

    from support.checkpoints import write_synthetic_checkpoint
    from support.models import sized_llama_config

    config = sized_llama_config(64 * 10**6, hidden_size=512, vocab_size=2048, dtype="float32")
    write_synthetic_checkpoint(config, str(tmp_path / "actor"), world_size=2)
    bucket = 4 * MiB
    report = export_cli(tmp_path / "actor", tmp_path / "out", "--backend", "nccl", "--workers", "2",
                        "--bucket-size", str(bucket), "--verify", "quick")
    largest = 0
    for name in os.listdir(tmp_path / "out"):
        if name.endswith(".safetensors"):
            with safe_open(str(tmp_path / "out" / name), framework="pt") as handle:
                largest = max(largest, *(handle.get_tensor(key).nbytes for key in handle.keys()))
    window = WINDOW * max(bucket, largest)
    assert report["bytes"]["gathered"] > 4 * window  # far more crossed the wire than the window
    for worker, peak in report["peak_gpu_bytes"].items():
        assert 0 < peak <= window + MiB, (worker, peak, window)


def test_a_staging_slot_round_trip_through_the_gpu_is_exact_and_pinned():
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    capacity = 8 * MiB
    staging = Staging(device, capacity)
    slot = staging.free.get()
    assert slot.host.is_pinned() and slot.wire.device == device
    pattern = torch.randint(0, 256, (capacity,), dtype=torch.uint8)
    slot.host.copy_(pattern)
    staging.to_wire(slot, capacity)
    torch.cuda.current_stream(device).synchronize()  # what a send's event does before reuse
    slot.host.zero_()  # only the GPU copy holds the pattern now: to_host must bring it back
    staging.to_host(slot, capacity)
    assert torch.equal(slot.host, pattern)
    assert torch.cuda.max_memory_allocated(device) - before == WINDOW * capacity  # the slots, nothing else
