"""Fixed cost: a small checkpoint through rayexport and through verl's merger, warm against warm,
every phase of rayexport's wall time, the local Ray alone (started and stopped, no export: the
floor any rayexport run that starts its own Ray pays), and `export_remote` with a warm pool, export 1 against 2.

    python benchmarks/startup_bench.py                     # 2.4 GB, world size 4, local disk
    python benchmarks/startup_bench.py --tree /tmp/old     # rayexport from another checkout

The checkpoint is scale_bench.py's (verl rank files written by 4 gloo ranks, a Llama config
sized to the target, bf16). Both tools are warm: each command runs once, unmeasured, before
the measured rounds (first imports compile bytecode and fill the page cache, and rayexport's
saves the model's description, in a folder of this invocation's own), then the rounds
alternate verl, `--verify quick`, `--verify full`. rayexport runs as a user runs it: the CLI
starting its own Ray (the wall includes Ray's start and stop), its defaults but
`--bucket-size`. Each rayexport row gives the report's phases; `unaccounted` is the wall less
their sum (the interpreter's start, what no phase times). The largest process is the peak RSS
of verl's merger (wait4) and, for rayexport, the largest of the report's driver, workers and
reload process. `export_remote` runs in one driver that starts Ray, exports the checkpoint
twice to two destinations with `pool=`, `--between` seconds apart (the training between two
checkpoints), and times each `ray.get`. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from export_bench import measure, remove, verl_python  # puts tests/ on sys.path
from plots import DOCS_IMAGES, phase_plot
from scale_bench import checkpoint

REMOTE_DRIVER = """
import json, sys, time
import ray
from rayexport import close_pool, export_remote
src, out, bucket, between = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
ray.init(include_dashboard=False, logging_level="WARNING")
runs = []
try:
    for n in (1, 2):
        if n > 1:
            time.sleep(between)  # the training steps between two checkpoints
        started = time.perf_counter()
        report = ray.get(export_remote(src, f"{out}-{n}", pool="bench", bucket_size=bucket, log_level="WARNING"))
        runs.append({"wall_s": time.perf_counter() - started, "seconds": report.seconds, "warm_start": report.warm_start,
                     "reload_process": getattr(report, "reload_process", {})})
finally:
    close_pool("bench")
    ray.shutdown()
print(json.dumps(runs))
"""


RAY_ALONE = """
import ray
from rayexport.orchestration.session import local_ray_settings, stop_started_ray
ray.init(**local_ray_settings("WARNING"))
stop_started_ray()
"""


def ray_alone(env: dict) -> dict:
    """A fresh interpreter that starts and stops the Ray the CLI starts, and does nothing else:
    the part of rayexport's wall that no change to rayexport can remove while it uses a local Ray."""
    wall, rss = measure([sys.executable, "-c", RAY_ALONE], env)
    return {"wall_s": wall, "largest": ("driver", rss)}


def rayexport_cli(src: str, out: str, verify: str, bucket: str, report: str, env: dict, options: tuple[str, ...] = ()) -> dict:
    """One CLI export starting its own Ray, with `options` added: wall seconds, phases, largest
    process (and the report's verification)."""
    remove(out, None)
    command = [sys.executable, "-m", "rayexport.run", "--src", src, "--dst", out, "--verify", verify,
               "--bucket-size", bucket, "--report", report, "--log-level", "WARNING", *options]
    wall, _ = measure(command, env)
    with open(report) as handle:
        result = json.load(handle)
    largest = max(result["peak_rss_bytes"], key=result["peak_rss_bytes"].get)
    return {"wall_s": wall, "seconds": result["seconds"], "largest": (largest, result["peak_rss_bytes"][largest]),
            "reload_process": result.get("reload_process", {}), "verification": result["verification"],
            "bytes": result["bytes"], "passes": result.get("passes", {})}


def verl_merger(src: str, out: str) -> dict:
    remove(out, None)
    command = [verl_python(), "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", src, "--target_dir", out]
    wall, rss = measure(command, dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    return {"wall_s": wall, "largest": ("merger", rss)}


def remote_pair(src: str, out: str, bucket: str, between: float, env: dict) -> list[dict]:
    """export_remote twice from one driver with one warm pool, `between` seconds apart."""
    for n in (1, 2):
        remove(f"{out}-{n}", None)
    result = subprocess.run([sys.executable, "-c", REMOTE_DRIVER, src, out, bucket, str(between)], env=env,
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def walls(runs: list[dict]) -> str:
    return ", ".join(f"{run['wall_s']:.1f}" for run in runs)


# The phases in the order an export runs them (a report's JSON sorts its keys).
PHASES = ("imports", "ray_start", "plan", "start_workers", "describe_model", "load", "plan_files", "source_digests",
          "source_scan", "transfer", "verify_files", "reload", "shutdown", "commit", "ray_stop")


def phase_table(rows: dict[str, list[dict]]) -> str:
    """Median seconds of each phase per rayexport row, and the wall."""
    names = list(PHASES)
    for runs in rows.values():
        for run in runs:
            names += [name for name in run["seconds"] if name not in names]
    lines = ["| phase | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
    for name in names + ["unaccounted", "wall"]:
        cells = []
        for runs in rows.values():
            if name == "wall":
                values = [run["wall_s"] for run in runs]
            elif name == "unaccounted":
                values = [run["wall_s"] - sum(run["seconds"].values()) for run in runs]
            else:
                values = [run["seconds"].get(name, 0.0) for run in runs]
            cells.append(f"{statistics.median(values):.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2.4GB")
    parser.add_argument("--bucket-size", default="128MB")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tree", help="run rayexport from this checkout (its folder) instead of the installed one")
    parser.add_argument("--skip-remote", action="store_true")
    parser.add_argument("--between", type=float, default=20.0,
                        help="seconds between the two export_remote calls, as training runs between checkpoints (default 20)")
    parser.add_argument("--workdir", default=os.path.join("/var/tmp", "rayexport-scale-bench"))
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plots", metavar="DIR", default=DOCS_IMAGES, help="where the phase plot goes (default docs/images)")
    parser.add_argument("--replot", metavar="JSON", help="only draw the plot again from a run's --json")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as handle:
            saved = json.load(handle)
        measured = {"verl": saved["verl"], "ray": saved["ray_alone"], "quick": saved["quick"], "full": saved["full"]}
        print("plot:", plot_phases(measured, saved["remote"], saved["nbytes"], args))
        return 0
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    if args.tree:
        env["PYTHONPATH"] = os.path.abspath(args.tree)
    os.makedirs(args.workdir, exist_ok=True)
    # the model descriptions the runs save (rayexport.model.saved): this invocation's own, from none
    env["RAYEXPORT_CACHE"] = os.path.join(args.workdir, "descriptions-cache")
    remove(env["RAYEXPORT_CACHE"], None)
    src, nbytes = checkpoint(args.workdir, args.size, "verl", False)
    out, report = os.path.join(args.workdir, "out"), os.path.join(args.workdir, "report.json")

    print("warming both tools: one unmeasured run of each command", flush=True)
    verl_merger(src, out)
    ray_alone(env)
    for verify in ("quick", "full"):
        rayexport_cli(src, out, verify, args.bucket_size, report, env)
    measured: dict[str, list[dict]] = {"verl": [], "ray": [], "quick": [], "full": []}
    for round_number in range(args.rounds):
        print(f"round {round_number + 1} of {args.rounds}", flush=True)
        measured["verl"].append(verl_merger(src, out))
        measured["ray"].append(ray_alone(env))
        for verify in ("quick", "full"):
            measured[verify].append(rayexport_cli(src, out, verify, args.bucket_size, report, env))
    remove(out, None)

    verl_wall = statistics.median(run["wall_s"] for run in measured["verl"])
    verl_rss = max(run["largest"][1] for run in measured["verl"])
    print(f"\n{nbytes / 1e9:.2f} GB checkpoint, world size 4, --bucket-size {args.bucket_size}, "
          f"{args.rounds} round(s), medians; rayexport from {args.tree or 'the installed package'}\n")
    print("| run | wall s (each round) | vs verl | largest process | vs verl |\n|---|---|---|---|---|")
    print(f"| verl model_merger | {verl_wall:.1f} ({walls(measured['verl'])}) | 1.00x | {verl_rss / 2**20:.0f} MiB (merger) | 1.00x |")
    ray_wall = statistics.median(run["wall_s"] for run in measured["ray"])
    print(f"| Ray alone: the CLI's local Ray started and stopped, no export | {ray_wall:.1f} ({walls(measured['ray'])}) "
          f"| {ray_wall / verl_wall:.2f}x | | |")
    for verify in ("quick", "full"):
        runs = measured[verify]
        wall = statistics.median(run["wall_s"] for run in runs)
        name, rss = max((run["largest"] for run in runs), key=lambda item: item[1])
        print(f"| rayexport --verify {verify} | {wall:.1f} ({walls(runs)}) "
              f"| {wall / verl_wall:.2f}x | {rss / 2**20:.0f} MiB ({name}) | {rss / verl_rss:.2f}x |")
    print(f"\nleft for the export itself within 1.2x verl, once Ray alone is paid: {1.2 * verl_wall - ray_wall:.1f} s; "
          f"within 1.5x: {1.5 * verl_wall - ray_wall:.1f} s")
    print("\nrayexport's phases (s):\n")
    print(phase_table({f"--verify {verify}": measured[verify] for verify in ("quick", "full")}), flush=True)
    remote = [] if args.skip_remote else remote_pair(src, os.path.join(args.workdir, "remote"), args.bucket_size, args.between, env)
    if remote:
        print(f"\nexport_remote with a warm pool, one driver, {args.between:.0f} s apart (--verify full):\n")
        print("| export | wall s | warm start | reload imports s / waited s |\n|---|---|---|---|")
        for number, run in enumerate(remote, start=1):
            process = run["reload_process"]
            print(f"| {number} | {run['wall_s']:.1f} | {run['warm_start']} | "
                  f"{process.get('imports_s', 0):.1f} / {process.get('waited_s', 0):.1f} |")
        print(f"\nexport 2 / export 1: {remote[1]['wall_s'] / remote[0]['wall_s']:.2f}x\n")
        print(phase_table({f"export {number}": [run] for number, run in enumerate(remote, start=1)}))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"verl": measured["verl"], "ray_alone": measured["ray"], "quick": measured["quick"], "full": measured["full"],
                       "remote": remote, "nbytes": nbytes}, handle, indent=2)
    print("\nplot:", plot_phases(measured, remote, nbytes, args))
    return 0


def plot_phases(measured: dict[str, list[dict]], remote: list[dict], nbytes: int, args) -> str:
    """docs' picture of the fixed cost: a stacked bar per run, of each phase's median seconds
    (verl's merger and Ray alone as one segment each)."""
    def medians(runs: list[dict]) -> dict[str, float]:
        phases = dict.fromkeys(name for run in runs for name in run["seconds"])
        return {name: statistics.median(run["seconds"].get(name, 0.0) for run in runs) for name in phases}

    bars = {
        "verl model_merger": {"verl's whole run": statistics.median(run["wall_s"] for run in measured["verl"])},
        "Ray alone (no export)": {"ray_start + ray_stop": statistics.median(run["wall_s"] for run in measured["ray"])},
        "rayexport --verify quick": medians(measured["quick"]),
        "rayexport --verify full": medians(measured["full"]),
        **{f"export_remote, warm pool: export {number}": medians([run]) for number, run in enumerate(remote, start=1)},
    }
    title = f"{nbytes / 1e9:.1f} GB checkpoint, world size 4, --bucket-size {args.bucket_size}: where each run's seconds go"
    return phase_plot(bars, os.path.join(args.plots, "fixed-cost-phases.png"), title, order=PHASES)


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"\nbenchmark: {time.perf_counter() - started:.0f} s")
    sys.exit(code)
