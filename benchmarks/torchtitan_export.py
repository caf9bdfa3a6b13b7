"""rayexport against torchtitan's own converter, `convert_to_hf.py`, on one torchtitan checkpoint.

    python benchmarks/torchtitan_export.py --converter /tmp/tt-bench/convert_to_hf.py
    python benchmarks/torchtitan_export.py --converter ... --flavor debugmodel --work /tmp/tt-small

`convert_to_hf.py` is not in torchtitan's wheel; it is `scripts/checkpoint_conversion/` in
pytorch/torchtitan, e.g. `git show release/0.3:scripts/checkpoint_conversion/convert_to_hf.py`
(the 0.3 release branch, the installed 0.3.0's). It runs unchanged, from WORK, with the Python
of tests/support/torchtitan_env.py. One invocation:
  1. writes a torchtitan 0.3.0 checkpoint of the registered Llama 3 `--flavor` with torchtitan's
     own code (tests/support/torchtitan_save.py: FSDP2 on 2 gloo ranks, its CheckpointManager;
     the final model-only float32 save of the initialised weights, step 0), unless WORK/<flavor>
     holds one already;
  2. runs the converter and `python -m rayexport.run` (a fresh local Ray of its own) on it, each
     once to warm up and once measured: wall seconds, and the peak RSS and PSS summed over the
     whole process tree (sampled), with the load average around each measured run;
  3. compares the two outputs tensor for tensor (names, dtypes, shapes, values exactly) and
     prints a markdown table; `--json` writes the results too.
Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import psutil
import torch
from safetensors import safe_open

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

from support.torchtitan_env import torchtitan_python  # noqa: E402

SAVE_SCRIPT = os.path.join(REPO, "tests", "support", "torchtitan_save.py")
MiB = 2**20
SAMPLE_S = 0.2


@dataclass
class Measured:
    """One measured run of one tool."""

    tool: str
    command: list[str]
    wall_s: float
    peak_rss_bytes: int  # the largest sum over the process tree at one sample
    peak_pss_bytes: int  # the same for PSS: shared pages (Ray's object store, libraries) counted once
    peak_processes: int
    load_before: float
    load_after: float
    files: dict[str, int] = field(default_factory=dict)  # path under the output: bytes
    report: dict | None = None  # rayexport's --report


class TreeSampler:
    """Samples the RSS and PSS of a process and all its descendants until it exits."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.peak_rss = self.peak_pss = self.peak_processes = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                processes = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            rss = pss = 0
            for process in processes:
                try:
                    rss += process.memory_info().rss
                    pss += _pss(process.pid)
                except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
                    continue
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.peak_processes = max(self.peak_processes, len(processes))
            self._done.wait(SAMPLE_S)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(tool: str, command: list[str], env: dict[str, str], cwd: str, log: str) -> Measured:
    """Run `command` to the end (its output to `log`); its wall time and process-tree peaks."""
    load_before = os.getloadavg()[0]
    with open(log, "w") as out:
        started = time.perf_counter()
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        sampler = TreeSampler(process.pid)
        returncode = process.wait()
        wall = time.perf_counter() - started
        sampler.stop()
    if returncode != 0:
        with open(log) as f:
            raise SystemExit(f"{tool} failed with exit code {returncode}:\n{f.read()[-3000:]}")
    return Measured(tool, command, round(wall, 2), sampler.peak_rss, sampler.peak_pss, sampler.peak_processes,
                    load_before, os.getloadavg()[0])


def output_files(folder: str) -> dict[str, int]:
    """Every file under `folder`, relative path: bytes."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, folder)] = os.path.getsize(path)
    return dict(sorted(files.items()))


def tensor_files(folder: str) -> dict[str, str]:
    """Tensor name: the top-level safetensors file of `folder` holding it (what a loader reads)."""
    where = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                where.update({key: os.path.join(folder, name) for key in f.keys()})
    return where


def compare(folder_a: str, folder_b: str) -> dict:
    """The two outputs tensor for tensor: names on one side only, and names whose dtype, shape or
    values differ (one tensor pair in memory at a time)."""
    a, b = tensor_files(folder_a), tensor_files(folder_b)
    differ = []
    for key in sorted(a.keys() & b.keys()):
        with safe_open(a[key], framework="pt") as fa, safe_open(b[key], framework="pt") as fb:
            ta, tb = fa.get_tensor(key), fb.get_tensor(key)
        if ta.dtype != tb.dtype or ta.shape != tb.shape or not torch.equal(ta, tb):
            differ.append(f"{key}: {ta.dtype}{list(ta.shape)} vs {tb.dtype}{list(tb.shape)}")
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    return dict(equal=not (differ or only_a or only_b), tensors=len(a.keys() & b.keys()), differ=differ,
                only_in_first=only_a, only_in_second=only_b)


def write_checkpoint(python: str, folder: str, flavor: str) -> tuple[str, float | None]:
    """The step folder of a torchtitan checkpoint of `flavor` under `folder` (written unless there
    already), and the seconds writing it took (None when reused)."""
    step = os.path.join(folder, "checkpoint", "step-0")
    if os.path.exists(os.path.join(step, ".metadata")) and os.path.exists(os.path.join(folder, "hf", "config.json")):
        return step, None
    shutil.rmtree(folder, ignore_errors=True)
    started = time.perf_counter()
    subprocess.run([python, SAVE_SCRIPT, "--out", folder, "--model", "llama3", "--flavor", flavor, "--save", "final",
                    "--steps", "0", "--dtype", "float32"], check=True, env=without_ray_address())
    return step, time.perf_counter() - started


def without_ray_address(**extra: str) -> dict[str, str]:
    """This process's environment without RAY_ADDRESS, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **extra}


def run_twice(tool: str, command_for, env: dict[str, str], work: str) -> Measured:
    """A warm-up run of `tool`, its output removed, then the measured run (its output kept)."""
    for attempt in ("warmup", "measured"):
        out = os.path.join(work, f"out-{tool}")
        shutil.rmtree(out, ignore_errors=True)
        print(f"{tool}: {attempt} run", flush=True)
        measured = measure(tool, command_for(out), env, work, os.path.join(work, f"{tool}-{attempt}.log"))
    measured.files = output_files(out)
    return measured


def table(runs: list[Measured], comparison: dict) -> str:
    """The markdown table of the measured runs."""
    lines = ["| tool | wall s | peak RSS MiB (tree) | peak PSS MiB (tree) | processes | output files | equal to the other |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for run in runs:
        safetensors = sum(1 for name in run.files if name.endswith(".safetensors"))
        files = f"{len(run.files)} ({safetensors} safetensors, {sum(run.files.values()) / 1e9:.2f} GB)"
        equal = f"yes, {comparison['tensors']} tensors" if comparison["equal"] else "NO"
        lines.append(f"| {run.tool} | {run.wall_s:.1f} | {run.peak_rss_bytes / MiB:.0f} | {run.peak_pss_bytes / MiB:.0f} "
                     f"| {run.peak_processes} | {files} | {equal} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--converter", required=True, help="torchtitan's scripts/checkpoint_conversion/convert_to_hf.py")
    parser.add_argument("--flavor", default="1B", help="registered torchtitan Llama 3 flavor (default: 1B)")
    parser.add_argument("--work", default="/tmp/tt-bench", help="scratch folder: checkpoint, outputs, logs, Ray")
    parser.add_argument("--json", help="write the results here (default: WORK/results.json)")
    parser.add_argument("--keep", action="store_true", help="keep both outputs (default: removed after the comparison)")
    args = parser.parse_args()
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    python = torchtitan_python(os.path.join(REPO, ".venv-torchtitan"))

    step, save_s = write_checkpoint(python, os.path.join(work, args.flavor), args.flavor)
    hf = os.path.join(work, args.flavor, "hf")
    print(f"checkpoint: {step} ({'reused' if save_s is None else f'written in {save_s:.0f} s'}, "
          f"{sum(output_files(step).values()) / 1e9:.2f} GB)", flush=True)

    converter = os.path.abspath(args.converter)
    titan = run_twice("convert_to_hf", lambda out: [
        python, converter, step, out, "--hf_assets_path", hf, "--model_name", "llama3", "--model_flavor", args.flavor,
        "--export_dtype", "float32",
    ], without_ray_address(), work)
    # RAY_ADDRESS=local: start a Ray of its own, never join another one found on this machine
    # (ray.init() joins the newest running one); its session files stay under WORK.
    ray_env = without_ray_address(RAY_ADDRESS="local", RAY_TMPDIR=os.path.join(work, "ray"))
    report = os.path.join(work, "rayexport-report.json")
    rayexport = run_twice("rayexport", lambda out: [
        sys.executable, "-m", "rayexport.run", "--src", step, "--dst", out, "--hf-config", hf, "--dtype", "float32",
        "--report", report,
    ], ray_env, work)
    with open(report) as f:
        rayexport.orchestration.report = json.load(f)

    comparison = compare(os.path.join(work, "out-convert_to_hf"), os.path.join(work, "out-rayexport"))
    runs = [titan, rayexport]
    print()
    print(table(runs, comparison))
    stages = rayexport.orchestration.report["seconds"]
    print(f"\nrayexport stages (s): {', '.join(f'{k} {v:.1f}' for k, v in stages.items())}")
    print("load average (1 min) before/after each measured run: "
          + ", ".join(f"{r.tool} {r.load_before:.1f}/{r.load_after:.1f}" for r in runs)
          + f" on {os.cpu_count()} CPUs")
    if not comparison["equal"]:
        print(json.dumps({k: v for k, v in comparison.items() if k != "equal"}, indent=2)[:3000])

    with open(args.converter, "rb") as f:
        converter_sha = hashlib.sha256(f.read()).hexdigest()
    results = dict(
        flavor=args.flavor, checkpoint=step, checkpoint_bytes=sum(output_files(step).values()), save_s=save_s,
        converter=converter, converter_sha256=converter_sha, cpus=os.cpu_count(), comparison=comparison,
        runs=[asdict(run) for run in runs], table=table(runs, comparison),
    )
    json_path = args.json or os.path.join(work, "results.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"results: {json_path}")
    if not args.keep:
        for tool in ("convert_to_hf", "rayexport"):
            shutil.rmtree(os.path.join(work, f"out-{tool}"), ignore_errors=True)
    return 0 if comparison["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
