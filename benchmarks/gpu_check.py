"""The NCCL path on a GPU machine, with or without Ray; prints one result line.

Writes a tiny tied FSDP2 checkpoint with gloo ranks, then exports it twice through
`run_export` itself, once over gloo and once over NCCL (one worker per GPU, up to the world
size), verifies both fully (reload and forward pass), and compares their bytes. It also puts
a staging slot through a host -> GPU -> host round trip and reads the GPU memory it held.

Without Ray (as on a machine that only has torch, transformers, peft, safetensors and
fsspec), the workers are local processes (`ProcessWorkerGroup`) that call the very
`ExportWorker` methods the Ray actors call, each seeing only its own GPU as Ray arranges it.
With `--ray` and Ray importable, the export runs on a local Ray instead. Without a GPU, only
the gloo export runs (a dry run of this script).

    python benchmarks/gpu_check.py [--ray]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future
from multiprocessing import get_context

import torch

from rayexport.orchestration.group import WorkerGroup
from rayexport.orchestration.job import run_export
from rayexport.orchestration.options import ExportOptions
from rayexport.orchestration.placement import Devices
from rayexport.orchestration.workers import ExportWorker

MiB = 2**20


def _serve(connection, index: int, size: int) -> None:
    """A worker process: one ExportWorker answering calls (name, args) until told to stop."""
    worker = ExportWorker(index, size, "WARNING")
    while (request := connection.recv()) is not None:
        call_id, name, args = request
        try:
            connection.send((call_id, True, getattr(worker, name)(*args)))
        except BaseException as error:  # noqa: BLE001 - handed to the driver, as Ray does
            connection.send((call_id, False, f"{type(error).__name__}: {error}"))


class ProcessActor:
    """A worker process behind the `actor.method.remote(*args)` calls WorkerGroup makes."""

    def __init__(self, index: int, size: int, visible_gpu: str | None) -> None:
        self.connection, child = get_context("spawn").Pipe()
        self.process = get_context("spawn").Process(target=_serve, args=(child, index, size), daemon=True)
        # what Ray does for a GPU actor; set in the environment the process starts with, since
        # an import may initialise CUDA before any code of ours runs there
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible_gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpu
        try:
            self.process.start()
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        self.pending: dict[int, Future] = {}
        self.lock = threading.Lock()
        self.next_id = 0
        threading.Thread(target=self._answers, daemon=True).start()

    def __getattr__(self, name: str):
        actor = self

        class _Method:
            @staticmethod
            def remote(*args) -> Future:
                with actor.lock:
                    actor.next_id += 1
                    future = actor.pending[actor.next_id] = Future()
                    actor.connection.send((actor.next_id, name, args))
                return future

            @staticmethod
            def options(**_ignored):
                # a process answers one call at a time, so a Ray concurrency group has no
                # meaning here: the consumer checks run before worker 0's file checks
                return _Method

        return _Method

    def _answers(self) -> None:
        try:
            while True:
                call_id, ok, value = self.connection.recv()
                future = self.pending.pop(call_id)
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(RuntimeError(value))
        except (EOFError, OSError):
            for future in self.pending.values():
                future.set_exception(RuntimeError("the worker process ended"))

    def stop(self) -> None:
        try:
            self.connection.send(None)
        except OSError:
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


class ProcessWorkerGroup(WorkerGroup):
    """The export's workers as local processes, one GPU each under NCCL; the consumer checks
    run in worker 0's process."""

    @classmethod
    def for_export(cls, options: ExportOptions, world_size: int, job_deadline: float) -> "ProcessWorkerGroup":
        size = min(options.workers or world_size, world_size)
        gpus = 1.0 if options.backend == "nccl" else 0.0
        return cls(size, Devices(options.backend, gpus, "gpu_check: local worker processes"), options, job_deadline)

    @staticmethod
    def connect(options: ExportOptions) -> None:
        """No Ray here: the workers are this machine's processes."""

    def start(self) -> None:
        nccl = self.devices.backend == "nccl"
        self.actors = [ProcessActor(index, self.size, str(index) if nccl else None) for index in range(self.size)]
        if self._verifies:  # the reload's process starts first, as on Ray
            self._get([self.actors[0].prepare_checks.remote()])
        host, port = self._get([self.actors[0].open_rendezvous.remote(self.options.timeout_s, "127.0.0.1")])[0]
        self._get([actor.join_group.remote(self.devices.backend, host, port, self.options.timeout_s) for actor in self.actors])

    def _get(self, futures: list[Future]) -> list:
        try:
            return [future.result(timeout=self.options.timeout_s) for future in futures]
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def progress_counts(self) -> None:
        return None  # no bar: these workers answer one call at a time

    def shutdown(self, graceful: bool = True) -> None:
        if graceful and self.actors:
            for future in [actor.close.remote() for actor in self.actors]:
                future.exception(timeout=60)
        for actor in self.actors:
            actor.stop()
        self.actors = []


def staging_round_trip(capacity: int = 64 * MiB) -> dict:
    """One staging slot through host -> GPU -> host on the worker's own stream: the bytes come
    back, the host buffer is pinned, and the GPU held the slot's buffer and no more."""
    from rayexport.transport.gather import Staging

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    staging = Staging(device, capacity, size=1)
    slot = staging.free.get()
    pattern = torch.randint(0, 256, (capacity,), dtype=torch.uint8)
    slot.host.copy_(pattern)
    started = time.perf_counter()
    staging.to_wire(slot, capacity)
    torch.cuda.current_stream(device).synchronize()  # what a send's event does before reuse
    slot.host.zero_()  # only the GPU copy holds the pattern now
    staging.to_host(slot, capacity)
    seconds = time.perf_counter() - started
    return {
        "equal": torch.equal(slot.host, pattern),
        "pinned": slot.host.is_pinned(),
        "gpu_bytes": torch.cuda.max_memory_allocated(device) - before,
        "gb_per_s": 2 * capacity / seconds / 1e9,
    }


def export_once(source: str, destination: str, backend: str, workers: int, use_ray: bool):
    options = ExportOptions(src=source, dst=destination, backend=backend, workers=workers, verify="full",
                            bucket_size="64KiB", log_level="WARNING")
    return run_export(options, None if use_ray else ProcessWorkerGroup)


def digests(folder: str) -> dict[str, str]:
    """sha256 of each weight file and index in an export folder."""
    found = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith((".safetensors", ".index.json")):
            with open(os.path.join(folder, name), "rb") as handle:
                found[name] = hashlib.sha256(handle.read()).hexdigest()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ray", action="store_true", help="run the exports on a local Ray (needs Ray)")
    args = parser.parse_args()
    from rayexport.demo import tiny_config, write_verl_checkpoint

    started = time.monotonic()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world_size = 3
    with tempfile.TemporaryDirectory(prefix="rayexport-gpu-check-") as scratch:
        checkpoint = os.path.join(scratch, "ckpt")
        write_verl_checkpoint(tiny_config("qwen2-tied"), checkpoint, world_size=world_size)
        fields = {"gpus": gpus, "ray": args.ray}
        try:
            gloo = export_once(checkpoint, os.path.join(scratch, "gloo"), "gloo", min(2, world_size), args.ray)
            fields["gloo_verified"] = gloo.verification.get("level") if gloo.verification.get("passed") else "no"
            if gpus:
                workers = min(gpus, world_size)
                nccl = export_once(checkpoint, os.path.join(scratch, "nccl"), "nccl", workers, args.ray)
                fields.update(
                    nccl_workers=nccl.workers,
                    nccl_verified=nccl.verification.get("level") if nccl.verification.get("passed") else "no",
                    devices=",".join(where["device"] for where in nccl.placement.values()),
                    bytes_equal=digests(os.path.join(scratch, "gloo")) == digests(os.path.join(scratch, "nccl")),
                    nccl_gpu_peak_kib=max(nccl.peak_gpu_bytes.values(), default=0) // 1024,
                    nccl_transfer_s=nccl.seconds.get("transfer"),
                )
                round_trip = staging_round_trip()
                fields.update(
                    staging_equal=round_trip["equal"], staging_pinned=round_trip["pinned"],
                    staging_gpu_mib=round(round_trip["gpu_bytes"] / MiB, 1), staging_gb_per_s=round(round_trip["gb_per_s"], 1),
                )
            passed = fields["gloo_verified"] == "full" and (not gpus or (
                fields["nccl_verified"] == "full" and fields["bytes_equal"] and fields["staging_equal"]
                and fields["staging_pinned"] and fields["staging_gpu_mib"] <= 64
            ))
        except Exception as error:  # noqa: BLE001 - one line, whatever went wrong
            traceback.print_exc(file=sys.stderr)
            fields["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
            passed = False
    fields["seconds"] = round(time.monotonic() - started, 1)
    print("gpu_check: " + ("PASS" if passed else "FAIL") + " " + " ".join(f"{key}={value}" for key, value in fields.items()))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
