"""The data path: rayexport against verl's merger where Ray is already up and where the CLI starts
its own, each phase's seconds and each phase's passes over the model's bytes, before and after.

    python benchmarks/data_path_bench.py                            # 2.4 GB, world size 4
    python benchmarks/data_path_bench.py --big 7.8GB --tree /tmp/before

The checkpoints are scale_bench.py's (verl rank files written by 4 gloo ranks, a Llama config
sized to the target, bf16; the big one written a rank at a time). In one invocation, on the
2.4 GB checkpoint (`--bucket-size 128MB`, the CLI's other defaults):
  - verl's merger (benchmarks/.venv-verl);
  - a Ray head started here (`ray start --head --block`, in a process group of its own, ended by
    that group's id when done), and the CLI joined to it through RAY_ADDRESS, as `ray job submit`
    runs on a cluster that is up: `--verify quick`, `--verify full`, and two `--verify full
    --pool P` runs, of which the second is measured (its actors are the first's); and `--verify
    quick` with no description saved by an earlier run (RAYEXPORT_CACHE empty), as the first
    export of a model runs;
  - the CLI starting its own Ray, `--verify quick` and `--verify full`.
With `--big SIZE`, on that checkpoint (`--bucket-size 256MB`): verl's merger and the CLI with its
own Ray at `--verify full`. With `--tree DIR`, every rayexport row also runs from that checkout
(its own Ray head, whose workers import it), so that before and after are measured in the same
invocation. Both tools are warm: each command runs once, unmeasured, before it is measured (which
leaves the model's description saved, in a folder of this invocation's own).
The largest process is verl's peak RSS (wait4) and the largest of the report's driver, workers
and reload process. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator

from export_bench import remove  # puts tests/ on sys.path
from scale_bench import checkpoint
from startup_bench import phase_table, rayexport_cli, verl_merger

SMALL_BUCKET, BIG_BUCKET = "128MB", "256MB"


@contextlib.contextmanager
def ray_head(env: dict[str, str], scratch: str) -> Iterator[dict[str, str]]:
    """A Ray head of this machine's CPUs, started by `ray start --head` for these runs in a
    process group of its own (its workers inherit `env`); the environment of a driver that joins
    it, once one has. Ended by signalling that group: nothing else."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Ray's token authentication, on by default for a new cluster: its drivers present the
    # token the head saved (~/.ray/auth_token), as a cluster's jobs do.
    env = dict(env, RAY_AUTH_MODE="token")
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    log = open(os.path.join(scratch, "ray-head.log"), "w")
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", f"--port={port}", "--include-dashboard=false", "--disable-usage-stats",
         f"--temp-dir={tempfile.mkdtemp(prefix='rb-', dir='/tmp')}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        joined = dict(env, RAY_ADDRESS=probe_head(port, env, head))
        yield joined
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        log.close()


def probe_head(port: int, env: dict[str, str], head: subprocess.Popen, timeout_s: float = 120.0) -> str:
    """The address of the head on `port`, once a driver has joined it (so that the first
    measured run does not pay the head's own start)."""
    deadline = time.monotonic() + timeout_s
    join = [sys.executable, "-c", f"import ray; ray.init(address='127.0.0.1:{port}', logging_level='ERROR'); "
            "print(ray.get_runtime_context().gcs_address); ray.shutdown()"]
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"the Ray head exited with {head.returncode}")
        joined = subprocess.run(join, env=env, capture_output=True, text=True)
        if joined.returncode == 0:
            return joined.stdout.strip().splitlines()[-1]
        time.sleep(1.0)
    raise RuntimeError(f"no Ray head on port {port} after {timeout_s:.0f} s")


def measured_twice(run, *args) -> dict:
    """`run(*args)` once to warm it, then once measured."""
    run(*args)
    return run(*args)


def tree_rows(src: str, workdir: str, env: dict[str, str], big: str | None) -> dict[str, dict]:
    """Every rayexport row of one tree: joined to a head, then with its own Ray (and the big
    checkpoint's row)."""
    out, report = os.path.join(workdir, "out"), os.path.join(workdir, "report.json")
    rows: dict[str, dict] = {}
    with ray_head(env, workdir) as joined:
        for verify in ("quick", "full"):
            rows[f"head, --verify {verify}"] = measured_twice(rayexport_cli, src, out, verify, SMALL_BUCKET, report, joined)
        # a model no export described before: its description derived again (transformers' model code imported)
        unsaved = dict(joined, RAYEXPORT_CACHE="")
        rows["head, --verify quick, model not described before"] = measured_twice(
            rayexport_cli, src, out, "quick", SMALL_BUCKET, report, unsaved,
        )
        pooled = ("--pool", "bench")
        rayexport_cli(src, out, "full", SMALL_BUCKET, report, joined, pooled)  # leaves the pool, warm
        rows["head, --verify full --pool, second run"] = rayexport_cli(src, out, "full", SMALL_BUCKET, report, joined, pooled)
    for verify in ("quick", "full"):
        rows[f"own Ray, --verify {verify}"] = measured_twice(rayexport_cli, src, out, verify, SMALL_BUCKET, report, env)
    if big:
        big_src, _ = checkpoint(workdir, big, "verl", True)
        rows[f"{big}, own Ray, --verify full"] = measured_twice(rayexport_cli, big_src, out, "full", BIG_BUCKET, report, env)
    remove(out, None)
    return rows


def passes_table(rows: dict[str, dict]) -> str:
    """Each row's passes over the model's bytes, per phase and kind (rows whose report has them)."""
    lines = ["| run | phase | " + " | ".join(KINDS) + " |", "|---|---|" + "---|" * len(KINDS)]
    for name, run in rows.items():
        written = run["bytes"]["written"]
        for phase, kinds in run.get("passes", {}).items():
            cells = [f"{kinds.get(kind, 0) / written:.2f}" if kinds.get(kind) else "" for kind in KINDS]
            lines.append(f"| {name} | {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


KINDS = ("read", "scanned", "hashed", "hashed_sha256", "copied", "sent", "received", "written")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2.4GB")
    parser.add_argument("--big", help="also this size, written a rank at a time (e.g. 7.8GB)")
    parser.add_argument("--tree", help="also run every rayexport row from this checkout (the before)")
    parser.add_argument("--workdir", default=os.path.join("/var/tmp", "rayexport-scale-bench"))
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    # the model descriptions the runs save (rayexport.model.saved): this invocation's own, from none
    descriptions = os.path.join(args.workdir, "descriptions-cache")
    remove(descriptions, None)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["RAYEXPORT_CACHE"] = descriptions
    src, nbytes = checkpoint(args.workdir, args.size, "verl", False)
    verl_out = os.path.join(args.workdir, "verl-out")
    verl = {args.size: measured_twice(verl_merger, src, verl_out)}
    if args.big:
        verl[args.big] = measured_twice(verl_merger, checkpoint(args.workdir, args.big, "verl", True)[0], verl_out)
    remove(verl_out, None)
    trees = {"after": (env, os.getcwd())}
    if args.tree:  # run from that checkout, so that `python -m rayexport.run` finds its package first
        tree = os.path.abspath(args.tree)
        trees = {"before": (dict(env, PYTHONPATH=tree), tree), **trees}
    results = {}
    for name, (tree_env, directory) in trees.items():
        with contextlib.chdir(directory):
            results[name] = tree_rows(src, args.workdir, tree_env, args.big)

    print(f"\n{nbytes / 1e9:.2f} GB checkpoint (verl, world size 4), --bucket-size {SMALL_BUCKET}"
          + (f"; {args.big} at --bucket-size {BIG_BUCKET}" if args.big else "") + "; each run once warm, once measured\n")
    print("| run | tree | wall s | x verl | largest process | x verl's peak |\n|---|---|---|---|---|---|")
    for size, run in verl.items():
        print(f"| verl model_merger, {size} | | {run['wall_s']:.1f} | 1.00x | {run['largest'][1] / 2**20:.0f} MiB | 1.00x |")
    for tree, rows in results.items():
        for name, run in rows.items():
            base = verl[args.big] if args.big and name.startswith(args.big) else verl[args.size]
            process, peak = run["largest"]
            print(f"| {name} | {tree} | {run['wall_s']:.1f} | {run['wall_s'] / base['wall_s']:.2f}x "
                  f"| {peak / 2**20:.0f} MiB ({process}) | {peak / base['largest'][1]:.2f}x |")
    for tree, rows in results.items():
        print(f"\nphases, {tree} (s):\n")
        print(phase_table({name: [run] for name, run in rows.items()}))
        if any(run.get("passes") for run in rows.values()):
            print(f"\npasses over the model's bytes, {tree} (bytes of each kind / bytes written):\n")
            print(passes_table(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"verl": verl, "results": results, "nbytes": nbytes}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
