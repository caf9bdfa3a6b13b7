"""Exports on a Ray cluster that advertises GPUs, as inside an RL job: the defaults must never
take the trainer's GPUs, `auto` must count the GPUs free now (not the cluster's total), and an
export that asks for GPUs it cannot get must say so within --placement-timeout.

The GPUs are fake (`ray.init(num_gpus=2)` on this CPU machine): Ray schedules them like real
ones and sets CUDA_VISIBLE_DEVICES in the actors, but torch finds no CUDA device there. So the
one scenario where `auto` picks NCCL ends, as it should on such a node, with the worker's own
one-line error. The script runs in a subprocess because this test process already belongs to
the session's Ray, which advertises no GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys, time
import ray
from rayexport import ExportError, ExportFailed, export, export_remote

source, root = sys.argv[1], sys.argv[2]
ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, logging_level="WARNING")


def report(name, **fields):
    print("RESULT " + json.dumps({"scenario": name, **fields}), flush=True)


def attempt(name, **options):
    started = time.monotonic()
    try:
        done = export(source, f"{root}/{name}", workers=2, verify="none", **options)
        report(name, backend=done.backend, reason=done.backend_reason,
               devices=sorted(where["device"] for where in done.placement.values()))
    except ExportError as error:
        report(name, error=str(error), seconds=time.monotonic() - started)


class SeesDevices:  # a consumer check that reports the devices its process was given

    def run(self, destination, *arguments):
        import os

        return {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


@ray.remote(num_gpus=2, num_cpus=0)
class Trainer:
    def gpus(self):
        return ray.get_gpu_ids()


try:
    # GPUs free, export_remote() with default options: gloo, no GPU taken
    done = ray.get(export_remote(source, f"{root}/remote-defaults"), timeout=600)
    report("remote_defaults", backend=done.backend, reason=done.backend_reason, passed=done.verification["passed"],
           devices=sorted(where["device"] for where in done.placement.values()), gpus_free=ray.available_resources().get("GPU", 0))
    # a fraction of a GPU per worker under auto: gloo on that share
    attempt("fraction", num_gpus_per_worker=0.5)

    # a consumer check asking for a GPU (the vLLM check) runs in a task holding one, if the cluster has that many
    from rayexport.storage.store import Store
    from rayexport.orchestration.workers import run_on_gpus

    report("check_on_a_gpu", **run_on_gpus(SeesDevices(), 1, Store(root), None, 60, 0, None))
    report("check_asking_too_many", **run_on_gpus(SeesDevices(), 3, Store(root), None, 60, 0, None))

    trainer = Trainer.remote()
    report("trainer", gpus=ray.get(trainer.gpus.remote()))
    attempt("auto_busy")  # 2 GPUs in the cluster, none free
    attempt("remote_nccl_busy_cli", backend="nccl", placement_timeout_s=1)
    try:
        ray.get(export_remote(source, f"{root}/remote-nccl", workers=2, backend="nccl", placement_timeout_s=1,
                              verify="none"), timeout=600)
    except ExportError as error:
        report("remote_nccl_busy", error=str(error), typed=isinstance(error, ExportFailed))
    ray.kill(trainer)
    while ray.available_resources().get("GPU", 0) < 2:
        time.sleep(0.1)
    attempt("auto_free")  # both free now: auto picks NCCL, and this node has no CUDA
finally:
    ray.shutdown()
"""


@pytest.fixture(scope="module")
def scenarios(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-cluster")
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    completed = subprocess.run(
        [sys.executable, "-c", SCRIPT, checkpoints["tied"].path, str(root)],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    results = [json.loads(line.removeprefix("RESULT ")) for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    return {result.pop("scenario"): result for result in results} | {"root": root}


def test_export_remote_with_default_options_stays_off_free_gpus(scenarios):
    result = scenarios["remote_defaults"]
    assert result["backend"] == "gloo" and result["passed"] is True
    assert set(result["devices"]) == {"cpu"}
    assert "--num-gpus-per-worker 0" in result["reason"]
    assert result["gpus_free"] == 2
    assert (scenarios["root"] / "remote-defaults" / "export_manifest.json").exists()


def test_a_fraction_of_a_gpu_never_picks_nccl(scenarios):
    result = scenarios["fraction"]
    assert result["backend"] == "gloo" and result["devices"] == ["cpu", "cpu"]
    assert "fraction of a GPU" in result["reason"]


def test_a_check_asking_for_a_gpu_runs_in_a_task_holding_one_and_without_enough_here(scenarios):
    on_gpu = scenarios["check_on_a_gpu"]
    assert len(on_gpu["ray_gpu_ids"]) == 1 and on_gpu["cuda_visible_devices"] == on_gpu["ray_gpu_ids"][0]
    assert "ray_gpu_ids" not in scenarios["check_asking_too_many"]  # run here, in the caller, on no GPU of Ray's


def test_auto_counts_the_free_gpus_not_the_total(scenarios):
    assert len(scenarios["trainer"]["gpus"]) == 2  # the trainer holds both
    result = scenarios["auto_busy"]
    assert result["backend"] == "gloo"
    assert result["reason"] == "0 of the cluster's 2 GPU(s) free, 2 needed for NCCL"


def test_gpus_that_cannot_be_placed_fail_within_the_placement_timeout(scenarios):
    result = scenarios["remote_nccl_busy_cli"]
    assert result["error"] == (
        "the Ray cluster cannot place 2 worker(s) of {CPU: 1, GPU: 1} within 1 s (--placement-timeout): "
        "missing GPU 2 needed, 0 free of 2"
    )
    assert result["seconds"] < 30
    assert not (scenarios["root"] / "remote_nccl_busy_cli" / "export_manifest.json").exists()
    remote = scenarios["remote_nccl_busy"]  # export_remote(backend="nccl") asks for a GPU per worker
    assert remote["typed"] and "missing GPU 2 needed, 0 free of 2" in remote["error"]


def test_auto_picks_nccl_when_gpus_are_free_and_a_node_without_cuda_says_so(scenarios):
    error = scenarios["auto_free"]["error"]
    assert error.startswith("worker ") and "was placed for NCCL (Ray GPU ids [" in error
    assert "torch finds no CUDA device" in error and "\n" not in error
    assert not (scenarios["root"] / "auto_free" / "export_manifest.json").exists()
