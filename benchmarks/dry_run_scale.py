"""`--dry-run` at the sizes the largest runs train: the planning's seconds and the driver's memory.

    python benchmarks/dry_run_scale.py                     # 235B Megatron (8 workers), 70B FSDP DCP (16)
    python benchmarks/dry_run_scale.py --runs 3 --print-plan

The checkpoints are `tests/support/sparse_megatron.py`'s, their tensor bytes holes: Qwen3-235B-A22B
as Megatron-Core saves it at PP4 x EP8 (470 GB, 24 725 chunks in 32 files) and Llama 3.3 70B as
DCP saves it from 64 FSDP2 ranks (141 GB, 46 272 chunks in 64 files). Each is planned through the
command line as a user runs it (`--dry-run --report`), once unmeasured and then `--runs` times,
without Ray (a Ray started here would only be sized against this machine's CPUs). Each run's wall
is measured here; the driver's peak resident memory and its stages come from the dry run's own
report. `benchmarks/megatron_scale.py` runs the real export of the same 235B save up to its
transfer, for the same plan made with the workers up. Nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # support: the sparse checkpoints' writers

MiB = 2**20


def plan(source: str, workers: int, report: str) -> tuple[float, dict, str]:
    """One dry run of `source` through the command line: its wall, its report and what it printed."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    command = [sys.executable, "-m", "rayexport.run", "--src", source, "--dst", os.path.join(os.path.dirname(report), "export"),
               "--workers", str(workers), "--dry-run", "--report", report, "--log-level", "WARNING"]
    started = time.perf_counter()
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        raise RuntimeError(f"the dry run of {source} failed:\n{completed.stderr[-3000:]}")
    with open(report) as handle:
        return wall, json.load(handle), completed.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="measured runs of each (after one unmeasured)")
    parser.add_argument("--print-plan", action="store_true", help="print each dry run's own output once")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "rayexport-dry-run-scale"))
    args = parser.parse_args(argv)
    from support.sparse_megatron import write_sparse_checkpoint, write_sparse_fsdp_dcp

    cases = {
        "Qwen3-235B-A22B, Megatron-Core PP4 x EP8": (os.path.join(args.workdir, "qwen3-235b", "actor"), 8, write_sparse_checkpoint),
        "Llama 3.3 70B, DCP from 64 FSDP2 ranks": (os.path.join(args.workdir, "llama3-70b", "dcp"), 16, write_sparse_fsdp_dcp),
    }
    rows = []
    for name, (source, workers, write) in cases.items():
        if not os.path.exists(source):
            write(source)
        report = os.path.join(os.path.dirname(source), "dry-run.json")
        _, _, printed = plan(source, workers, report)  # unmeasured: the page cache and the imports warm
        if args.print_plan:
            print(printed)
        walls, peaks, stages = [], [], []
        for _ in range(args.runs):
            wall, planned, _ = plan(source, workers, report)
            walls.append(wall)
            peaks.append(planned["driver_peak_rss_bytes"])
            stages.append(planned["seconds"])
        cost = planned["cost"]
        rows.append((name, workers, cost["tensor_count"], cost["tensor_bytes"], walls, peaks, stages[walls.index(statistics.median_low(walls))]))
    print(f"{'checkpoint':<44} {'workers':>7} {'tensors':>8} {'GB':>7} {'wall s (median, range)':>24} {'driver peak':>12}  stages (median run)")
    for name, workers, tensors, nbytes, walls, peaks, stages in rows:
        spread = f"{statistics.median(walls):.1f} ({min(walls):.1f}-{max(walls):.1f})"
        print(f"{name:<44} {workers:>7} {tensors:>8} {nbytes / 1e9:>7.1f} {spread:>24} {max(peaks) / MiB:>8.0f} MiB  "
              + ", ".join(f"{stage} {seconds:.1f}" for stage, seconds in stages.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
