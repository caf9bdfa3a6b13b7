"""A Qwen3-235B-A22B-sized Megatron-Core checkpoint through the command line, up to its transfer.

    python benchmarks/megatron_scale.py                      # PP4 x EP8, 2 workers
    python benchmarks/megatron_scale.py --workers 4 --seconds 20

The checkpoint is `tests/support/sparse_megatron.py`'s: every file, record and `.metadata` entry
of a torch_dist save of that size (470 GB of `.distcp` files, 24 708 chunks over 32 files), its
tensor bytes holes, so it takes a few MB of this machine's disk. rayexport is run on it as a user
runs it, joined to a Ray head started here, with `--verify none` and a destination in the work
folder; once the transfer has run `--seconds`, the command line is interrupted (SIGINT, as
Ctrl-C) and its destination removed: the bytes are zeros, and 470 GB would not fit this disk.

It prints each phase the command line reported, the largest resident memory of the driver and
of each worker, the bytes under the workers' spool folders (DCP files are read where they lie:
none), and the transfer's progress line when it was stopped. Nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # support: the sparse checkpoint's writer

from rayexport.common.memory import status_bytes  # noqa: E402

GB = 10**9
MiB = 2**20
_PHASE = re.compile(r"rayexport\.orchestration\.report: (\w+): (?:[\d.]+ GB in )?([\d.]+) s")


def worker_pids(ray) -> list[int]:
    """The export's workers: the processes of this session's raylet that run an export worker actor."""
    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except OSError:
            continue
        if parent == raylet and b"ExportWorkerActor" in command:
            found.append(int(entry))
    return sorted(found)


def folder_bytes(root: str) -> int:
    """Bytes the files under `root` take on disk (blocks, so that holes count as nothing)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:
                pass
    return total


def run(actor: str, out: str, workers: int, seconds: float, env: dict[str, str], ray) -> dict:
    """The command line on `actor` until its transfer has run `seconds`: its phases, memory,
    spool bytes and the transfer's progress when it was stopped."""
    from rayexport.orchestration.spool import spool_root

    command = [sys.executable, "-m", "rayexport.run", "--src", actor, "--dst", out, "--workers", str(workers),
               "--verify", "none", "--log-level", "INFO"]
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    phases: dict[str, float] = {}
    transferring = threading.Event()
    lines: list[str] = []
    progress: list[str] = []

    def follow() -> None:
        for line in process.stderr:
            lines.append(line)
            found = _PHASE.search(line)
            if found:
                phases[found.group(1)] = float(found.group(2))
            if "progress: transfer:" in line:
                progress.append(line.split("progress: ", 1)[1].strip())
                transferring.set()

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    pids: list[int] = []
    peaks = {"driver": 0}
    spooled = 0
    while process.poll() is None and not transferring.wait(0.5):
        pids = worker_pids(ray) if len(pids) < workers else pids
        spooled = max(spooled, folder_bytes(spool_root()))
    to_transfer = time.perf_counter() - started
    transfer_start = time.perf_counter()
    while process.poll() is None and time.perf_counter() - transfer_start < seconds:
        time.sleep(0.5)
        spooled = max(spooled, folder_bytes(spool_root()))
    for index, pid in enumerate(pids):
        peaks[f"worker{index}"] = status_bytes("VmHWM", pid)
    peaks["driver"] = status_bytes("VmHWM", process.pid)
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    code = process.wait(timeout=120)
    reader.join(timeout=10)
    if not transferring.is_set():
        raise RuntimeError(f"the export ended before its transfer (exit {code}):\n{''.join(lines[-20:])}")
    return {"phases": phases, "to_transfer_s": to_transfer, "peaks": peaks, "spooled": spooled,
            "progress": progress[-1], "exit": code}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="rayexport workers (default 2)")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="how long the transfer runs before it is stopped (it writes zeros: about 1 GB a second here)")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages of the save (default 4)")
    parser.add_argument("--expert-ranks", type=int, default=8, help="expert parallel ranks of the save (default 8)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "rayexport-megatron-scale"))
    args = parser.parse_args(argv)
    import ray

    from support.sparse_megatron import write_sparse_checkpoint

    actor = os.path.join(args.workdir, f"pp{args.stages}-ep{args.expert_ranks}", "global_step_1", "actor")
    marker = os.path.join(actor, "dist_ckpt", "metadata.json")
    if not os.path.exists(marker):
        shutil.rmtree(os.path.dirname(os.path.dirname(actor)), ignore_errors=True)
        started = time.perf_counter()
        nbytes = write_sparse_checkpoint(actor, stages=args.stages, expert_ranks=args.expert_ranks)
        print(f"wrote {nbytes / GB:.0f} GB of holes in {time.perf_counter() - started:.1f} s to {actor}", flush=True)
    folder = os.path.join(actor, "dist_ckpt")
    files = [name for name in os.listdir(folder) if name.endswith(".distcp")]
    apparent = sum(os.path.getsize(os.path.join(folder, name)) for name in files)
    out = os.path.join(args.workdir, "out")
    shutil.rmtree(out, ignore_errors=True)
    ray.init(num_cpus=args.workers + 1, include_dashboard=False, logging_level="WARNING")
    try:
        env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
        result = run(actor, out, args.workers, args.seconds, env, ray)
    finally:
        ray.shutdown()
        shutil.rmtree(out, ignore_errors=True)
    print(f"\n{apparent / GB:.0f} GB in {len(files)} .distcp files ({folder_bytes(folder) / MiB:.0f} MiB on disk), "
          f"{args.workers} workers joined to a Ray head\n")
    print(f"phases (s): " + ", ".join(f"{name} {seconds:.1f}" for name, seconds in result["phases"].items()))
    print(f"from the command's start to its transfer: {result['to_transfer_s']:.1f} s")
    print("largest resident memory: " + ", ".join(f"{name} {peak / MiB:.0f} MiB" for name, peak in result["peaks"].items()))
    print(f"bytes under the workers' spool folders: {result['spooled']}")
    print(f"after {args.seconds:.0f} s of transfer: {result['progress']}; then interrupted (exit {result['exit']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
