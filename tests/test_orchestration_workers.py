"""rayexport.orchestration.workers: a worker's memory stays at the transfer window, whatever it reads; and a
worker that dies mid-gather ends the export within seconds, taking the others with it.

Sizes are small enough for this machine but chosen so the bound is far below what each worker
reads: a worker that held its rank file's pages, or buffered more than the window, fails."""

import json
import os
import signal
import threading
import time

import pytest
import ray
import torch
from safetensors import safe_open

from rayexport.common.errors import ExportError
from rayexport.orchestration.job import export
from support.checkpoints import write_synthetic_checkpoint
from support.helpers import export_worker_processes
from support.models import sized_llama_config

MiB = 2**20
BUCKET = 8 * MiB
# Allocator slack, the writer thread's arena, Python objects: generous (measured: 35-38 MiB in
# all with a 16 MiB window), yet well under the 80 MB each worker reads (110 MiB when the
# pages read are not given back).
HEADROOM = 40 * MiB


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A 160 MB world-size-2 checkpoint: 80 MB of rank file per worker."""
    config = sized_llama_config(160 * 10**6, hidden_size=512, vocab_size=2048, dtype="float32")
    source = tmp_path_factory.mktemp("synthetic") / "actor"
    return source, write_synthetic_checkpoint(config, str(source), world_size=2)


def test_workers_hold_a_bounded_window_and_two_writers_split_the_files(synthetic, tmp_path, ray_address):
    source, checkpoint_bytes = synthetic
    assert checkpoint_bytes / 2 > 2 * BUCKET + HEADROOM  # each worker reads more than the bound

    report = export(
        str(source), str(tmp_path / "out"), workers=2, writers=2, bucket_size=BUCKET,
        max_shard_size="32MB", verify="none", dtype="float32",
    )

    for worker, growth in report.working_memory_bytes.items():
        assert growth is not None and growth <= 2 * BUCKET + HEADROOM, f"{worker} grew {growth / MiB:.0f} MiB"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 4
    written = {worker: [name for name in names if name.endswith(".safetensors")] for worker, names in report.files_by_worker.items()}
    assert written["worker0"] and written["worker1"]  # each writer uploaded its own share
    assert sorted(written["worker0"] + written["worker1"]) == files
    # a row-sharded tensor arrives whole and in order
    shards = [torch.load(source / f"model_world_size_2_rank_{rank}.pt", mmap=True, weights_only=True) for rank in range(2)]
    name = "model.embed_tokens.weight"
    expected = torch.cat([shard[name].to_local() for shard in shards])
    with safe_open(str(tmp_path / "out" / index["weight_map"][name]), framework="pt") as handle:
        assert torch.equal(handle.get_tensor(name), expected)


def test_by_default_every_worker_writes_an_equal_share(synthetic, tmp_path, ray_address, monkeypatch):
    """Without --writers every worker writes, and an export of at least a share per writer is cut
    into that many files of about equal size (the share, 1 GiB, is lowered to fit this checkpoint)."""
    import rayexport.plan.schedule as schedule

    monkeypatch.setattr(schedule, "WRITER_SHARE", 32 * MiB)
    source, _ = synthetic
    report = export(str(source), str(tmp_path / "out"), workers=2, bucket_size=BUCKET, verify="quick", dtype="float32")
    written = {worker: [name for name in names if name.endswith(".safetensors")] for worker, names in report.files_by_worker.items()}
    assert sorted(map(len, written.values())) == [1, 1]  # one file each
    sizes = [report.files[name]["size"] for names in written.values() for name in names]
    assert abs(sizes[0] - sizes[1]) <= 4 * MiB  # within one tensor: the embedding, 2048 x 512 float32


def test_a_worker_killed_mid_gather_ends_the_export_within_seconds(synthetic, tmp_path, ray_address):
    source, _ = synthetic
    destination = tmp_path / "out"
    outcome: dict = {}

    def run() -> None:
        try:
            export(str(source), str(destination), workers=2, bucket_size=MiB, max_shard_size="16MB", verify="none")
        except ExportError as error:
            outcome["error"] = error
        outcome["ended"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    while not list(destination.glob("model-00001-of-*.safetensors")):  # the gather is under way
        assert thread.is_alive() and time.monotonic() < deadline, "the export ended before a shard was written"
        time.sleep(0.02)
    victim = max(export_worker_processes(), key=lambda process: process.pid)  # the later-started worker
    killed = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(timeout=120)

    assert "an export worker died" in str(outcome.get("error")), outcome
    assert f"(pid {victim.pid}) on node " in str(outcome["error"]), outcome  # which worker, and where
    assert outcome["ended"] - killed < 20, f"the driver took {outcome['ended'] - killed:.0f} s to notice"
    assert not (destination / "export_manifest.json").exists()
    remaining = time.monotonic() + 15
    while export_worker_processes() and time.monotonic() < remaining:  # the others are killed too
        time.sleep(0.2)
    assert not export_worker_processes()
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


# --- an NCCL worker's GPU -----------------------------------------------------------------------

def test_an_nccl_worker_binds_the_gpu_index_it_was_given(monkeypatch):
    """torch.cuda is patched here, and only here, because this machine has no GPU: the worker
    must hand `set_device` an index (a bare torch.device("cuda") is refused by torch), the first
    of the devices Ray made visible to it, before NCCL starts."""
    from rayexport.orchestration.workers import ExportWorker

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # what Ray sets in an actor given GPU 3
    monkeypatch.setattr("rayexport.orchestration.workers._assigned_gpus", lambda: [3])
    worker = ExportWorker(0, 1, "WARNING")
    host, port = worker.open_rendezvous(30, host="127.0.0.1")
    # this CPU build of torch has no NCCL: joining fails, but only after the device was bound
    with pytest.raises((RuntimeError, ValueError)):
        worker.join_group("nccl", host, port, 30)
    assert calls == [("set_device", 0)]
    assert worker.device == torch.device("cuda", 0)
    worker.close()


def test_a_worker_placed_for_nccl_without_cuda_says_so(monkeypatch):
    from rayexport.orchestration.workers import ExportWorker

    monkeypatch.setattr("rayexport.orchestration.workers._assigned_gpus", lambda: [0])
    worker = ExportWorker(1, 2, "WARNING")
    with pytest.raises(ExportError, match=r"^worker 1 was placed for NCCL \(Ray GPU ids \[0\].*torch finds no CUDA device"):
        worker.join_group("nccl", "127.0.0.1", 1, 30)
