"""rayexport against the storage floor and verl's model merger, side by side on the same data.

    python benchmarks/export_bench.py                  # 1 GB and 4 GB, world size 4
    python benchmarks/export_bench.py --sizes 256MB --workers 1,2 --skip-verl

One invocation builds synthetic verl FSDP2 checkpoints (real DTensor rank files written by
gloo ranks; a Llama config sized to the target, bf16) on local disk and on a moto S3 server
over HTTP, then times on the same bytes:
  1. the floor: `cp -r` of the checkpoint (local) and s3fs `put` of it (S3);
  2. verl's model merger (`python -m verl.model_merger merge --backend fsdp`), installed into a
     separate virtualenv the script creates (benchmarks/.venv-verl), local only;
  3. rayexport with 1, 2 and 4 workers (and `--writers`), at each `--verify` level, local and
     S3, through the CLI as a user runs it, joined to one Ray instance whose start-up is
     reported on its own line (as `ray job submit` runs it on a cluster that is up).
Both tools are warm: verl's merger and one rayexport export run once, unmeasured, on the first
size. It also measures worker start-up for exports in a row with and without a warm pool, and
the gather transports on this node (gloo point-to-point against Ray's shared-memory object
store), prints markdown tables, and draws the local runs' wall time and peak memory against
checkpoint size (`--plots DIR`, default docs/images). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # support: the tests' FSDP2 checkpoint writers

from support.checkpoints import write_synthetic_checkpoint  # noqa: E402
from support.models import sized_llama_config  # noqa: E402
from plots import DOCS_IMAGES, SizePoint, size_plot  # noqa: E402

VERL_VENV = os.path.join(HERE, ".venv-verl")
VERL_VERSION = "0.9.1"
BUCKET = "bench"
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench-key", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}
MiB = 2**20


# --- running and measuring ---------------------------------------------------------------------


@dataclass
class Run:
    size: str
    name: str
    wall_s: float
    export_s: float | None = None  # rayexport: plan + load + transfer + commit (no Ray or actor start)
    start_s: float | None = None  # rayexport: worker actors and process group start
    stages: dict[str, float] | None = None
    peak_rss: dict[str, int] | None = None
    floor_s: float | None = None
    verl_s: float | None = None
    nbytes: int = 0


def measure(command: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> tuple[float, int]:
    """Run `command` (in `cwd`); its wall seconds and the peak RSS of its own process (wait4's rusage)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])}... failed:\n{stderr.decode()[-3000:]}")
    return seconds, usage.ru_maxrss * 1024


CGROUP_ROOT = "/sys/fs/cgroup/memory"


def measure_capped(command: list[str], env: dict[str, str] | None, cap_bytes: int) -> tuple[float, int, int]:
    """Run `command` inside a cgroup-v1 memory cap of `cap_bytes` (so that a baseline that needs
    more than the machine has is killed by the kernel inside its cap, not the machine taken down):
    its wall seconds, peak RSS and exit code (negative: the signal that ended it)."""
    group = os.path.join(CGROUP_ROOT, f"rayexport-bench-{os.getpid()}")
    os.makedirs(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as handle:
            handle.write(str(cap_bytes))
        started = time.perf_counter()
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=lambda: open(os.path.join(group, "cgroup.procs"), "w").write(str(os.getpid())),
        )
        _, status, usage = os.wait4(process.pid, 0)
        return time.perf_counter() - started, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)
    finally:
        os.rmdir(group)


# moto's S3 server in a process of its own, on a port the OS picks as the server binds it (a port
# picked first and released could be taken by another process before the server binds it); it
# prints the port, then serves until it is ended.
MOTO_SERVER = (
    "import threading; from moto.server import ThreadedMotoServer; "
    "server = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False); server.start(); "
    "print(server.get_host_and_port()[1], flush=True); threading.Event().wait()"
)


def start_moto_server() -> tuple[subprocess.Popen, str]:
    """moto's S3 server (ended by the caller, by its pid) and its endpoint, once it listens."""
    server = subprocess.Popen([sys.executable, "-c", MOTO_SERVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    port = server.stdout.readline().strip()
    if not port.isdigit():
        server.kill()
        raise RuntimeError(f"moto's S3 server did not start (exit status {server.wait()})")
    return server, f"http://127.0.0.1:{port}"


def start_moto() -> tuple[subprocess.Popen, str]:
    """`start_moto_server`, with the benchmarks' bucket created."""
    server, endpoint = start_moto_server()
    import boto3

    boto3.client("s3", endpoint_url=endpoint, **_boto_credentials()).create_bucket(Bucket=BUCKET)
    return server, endpoint


def _boto_credentials() -> dict[str, str]:
    return {"aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"],
            "region_name": S3_ENV["AWS_DEFAULT_REGION"]}


def verl_python() -> str:
    """The virtualenv with verl (and the CPU torch wheel), created on first use."""
    python = os.path.join(VERL_VENV, "bin", "python")
    if not os.path.exists(python):
        print("creating", VERL_VENV, "with verl (once; a few minutes)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", VERL_VENV], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}"], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", f"verl=={VERL_VERSION}"], check=True)
    return python


def rayexport_run(
    src: str, dst: str, workers: int, writers: int | None, bucket_size: str, env: dict[str, str], report: str,
    verify: str = "none", extra: tuple[str, ...] = (), tree: str | None = None,
) -> tuple[float, dict]:
    """One export through the command line (`writers` None: its default, every worker), from the
    checkout `tree` (None: this one); its wall and its report."""
    command = [
        sys.executable, "-m", "rayexport.run", "--src", src, "--dst", dst, "--workers", str(workers),
        *(("--writers", str(writers)) if writers is not None else ()), "--verify", verify, "--bucket-size", bucket_size,
        "--report", report, "--log-level", "WARNING", *extra,
    ]
    if tree is not None:  # its workers, and `python -m`, which puts its working directory first on the path
        env = dict(env, PYTHONPATH=tree)
    seconds, _ = measure(command, env, tree)
    with open(report) as handle:
        return seconds, json.load(handle)


# The checkout these benchmarks belong to: the "after" of a comparison with `--before TREE`.
THIS_TREE = os.path.dirname(HERE)


@contextlib.contextmanager
def ray_head(tree: str, num_cpus: int) -> Iterator[tuple[dict[str, str], float]]:
    """A Ray head in a process of its own whose workers import rayexport from the checkout
    `tree` (its PYTHONPATH, which the raylet's worker processes inherit); the environment a
    process joins it with, and how long it took to start. It is stopped, by its own
    `ray.shutdown`, when the block ends."""
    script = ("import json, os, ray, sys; ray.init(num_cpus=int(sys.argv[1]), include_dashboard=False, logging_level='WARNING'); "
              "print(json.dumps({'RAY_ADDRESS': ray.get_runtime_context().gcs_address, "
              "**{key: value for key, value in os.environ.items() if key == 'RAY_AUTH_MODE'}}), flush=True); "
              "sys.stdin.read(); ray.shutdown()")
    started = time.perf_counter()
    head = subprocess.Popen([sys.executable, "-c", script, str(num_cpus)], env=dict(os.environ, PYTHONPATH=tree),
                            cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        joining = head.stdout.readline().strip()
        if not joining:
            raise RuntimeError("the Ray head did not start")
        # what a process joining it needs: its address, and the token mode Ray set for the head's children
        yield json.loads(joining), time.perf_counter() - started
    finally:
        head.stdin.close()
        head.wait(timeout=120)


def against_rayexport(
    baseline: tuple[str, list[str], dict[str, str] | None], src: str, out: str, levels: list[str], workers: int,
    bucket_size: str, report: str, extra: tuple[str, ...] = (), cap_bytes: int | None = None, before: str | None = None,
    own_ray: bool = False,
) -> tuple[float, list[dict]]:
    """One baseline `(name, command, env)` against rayexport's command line at each `--verify`
    level, on `src`, each run once unmeasured first (both sides warm), then measured; rayexport
    joined to a Ray head (its start, returned first, is not in its walls), with its default
    writers, and with `own_ray` also starting its own Ray. With `before` (a checkout), each level
    also runs from that tree, driver and workers (on a head of its own). With `cap_bytes` the
    baseline runs inside that memory cap (`measure_capped`) and may be killed. The rows: run,
    wall_s and peak_bytes (the baseline's `exit`, rayexport's largest process and stages)."""
    name, command, env = baseline
    trees = ([("before: ", os.path.abspath(before))] if before else []) + [("", THIS_TREE)]
    own_env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    rows, ray_start_s = [], 0.0

    def rayexport_rows(label: str, tree: str, environment: dict[str, str], warming: bool) -> None:
        for level in levels:
            shutil.rmtree(out, ignore_errors=True)
            seconds, measured = rayexport_run(src, out, workers, None, bucket_size, environment, report, level, extra, tree)
            if not warming:
                process, peak = max(measured["peak_rss_bytes"].items(), key=lambda item: item[1])
                rows.append({"run": f"{label}rayexport, `--verify {level}`", "wall_s": seconds, "peak_bytes": peak,
                             "largest": process, "stages": measured["seconds"], "passes": measured.get("passes")})

    try:
        for warming in (True, False):
            shutil.rmtree(out, ignore_errors=True)
            seconds, peak, code = measure_capped(command, env, cap_bytes) if cap_bytes else (*measure(command, env), 0)
            if not warming:
                rows.append({"run": name, "wall_s": seconds, "peak_bytes": peak, "exit": code})
            for label, tree in trees:
                with ray_head(tree, workers + 1) as (joining, started_s):
                    ray_start_s = started_s
                    rayexport_rows(label, tree, dict(own_env, **joining), warming)
                if own_ray:
                    rayexport_rows(f"{label}own Ray, ", tree, own_env, warming)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return ray_start_s, rows


def print_against(rows: list[dict], ratio: str) -> None:
    """`against_rayexport`'s rows as a table, each wall also as a multiple of the baseline's (none
    where the baseline did not finish: killed at its memory cap)."""
    finished = rows[0].get("exit", 0) == 0
    print(f"| run | wall s | {ratio} | largest process |\n| --- | ---: | ---: | --- |")
    for row in rows:
        where = f" ({row['largest']})" if "largest" in row else ""
        if row.get("exit", 0) != 0:
            where += f", ended with exit {row['exit']}: killed at its memory cap" if row["exit"] == -9 else f", exit {row['exit']}"
        multiple = f"{row['wall_s'] / rows[0]['wall_s']:.2f}" if finished else "-"
        print(f"| {row['run']} | {row['wall_s']:.1f} | {multiple} | {row['peak_bytes'] / MiB:.0f} MiB{where} |")
    print()
    for row in rows:
        if row.get("stages"):
            print(f"{row['run']}: " + ", ".join(f"{stage} {seconds:.1f}" for stage, seconds in row["stages"].items()))


def remove(uri: str, s3) -> None:
    if uri.startswith("s3://"):
        if s3.exists(uri):
            s3.rm(uri, recursive=True)
    else:
        shutil.rmtree(uri, ignore_errors=True)


# --- the transport comparison --------------------------------------------------------------------


def transport_bench(megabytes: int, repeats: int) -> dict[str, float]:
    """MB/s moving one buffer between two actors on this node: gloo send/recv against
    ray.put in one actor and ray.get (zero-copy from shared memory) in the other."""
    import ray

    @ray.remote(num_cpus=0)
    class Peer:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def address(self) -> tuple[str, int]:
            from rayexport.transport import gather as transport

            self.store = transport.open_rendezvous("127.0.0.1", 120)
            return "127.0.0.1", self.store.port

        def join(self, host: str, port: int) -> None:
            from rayexport.transport import gather as transport

            transport.join_group("gloo", self.rank, 2, host, port, 120, store=getattr(self, "store", None))

        def gloo(self, nbytes: int, repeats: int) -> float:
            import torch.distributed as dist

            buffer = torch.ones(nbytes, dtype=torch.uint8) if self.rank else torch.empty(nbytes, dtype=torch.uint8)
            dist.barrier()
            started = time.perf_counter()
            for _ in range(repeats):
                if self.rank:
                    dist.send(buffer, dst=0)
                else:
                    dist.recv(buffer, src=1)
            dist.barrier()
            return time.perf_counter() - started

        def put(self, nbytes: int):
            return [ray.put(torch.ones(nbytes, dtype=torch.uint8).numpy())]

        def get(self, references) -> int:
            array = ray.get(references[0])
            return int(array[-1])

    nbytes = megabytes * MiB
    peers = [Peer.remote(rank) for rank in range(2)]
    host, port = ray.get(peers[0].address.remote())
    ray.get([peer.join.remote(host, port) for peer in peers])
    gloo_s = max(ray.get([peer.gloo.remote(nbytes, repeats) for peer in peers]))
    started = time.perf_counter()
    for _ in range(repeats):
        ray.get(peers[0].get.remote(ray.get(peers[1].put.remote(nbytes))))
    object_store_s = time.perf_counter() - started
    for peer in peers:
        ray.kill(peer)
    total = nbytes * repeats / 1e6
    return {"gloo send/recv": total / gloo_s, "Ray object store put/get": total / object_store_s}


# --- start-up with and without a warm pool -------------------------------------------------------


def startup_bench(src: str, out: str, workers: int, exports: int) -> dict[str, list[float]]:
    """Seconds of the start_workers stage (actors and process group) for `exports` exports in a
    row through `export_remote`, as an RL loop calls it: without a pool, and with one."""
    import ray

    from rayexport import close_pool, export_remote

    seconds: dict[str, list[float]] = {}
    for label, pool in (("no pool", None), ("warm pool", "bench")):
        seconds[label] = []
        for index in range(exports):
            report = ray.get(export_remote(src, f"{out}-{index}", workers=workers, verify="none", force=True, pool=pool))
            seconds[label].append(report.seconds["start_workers"])
            shutil.rmtree(f"{out}-{index}", ignore_errors=True)
    close_pool("bench")
    return seconds


# --- the benchmark ---------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    from rayexport.orchestration.options import parse_size as parse

    return parse(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1GB,4GB", help="checkpoint sizes (default 1GB,4GB)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--workers", default="1,2,4", help="rayexport worker counts (default 1,2,4)")
    parser.add_argument("--writers", type=int, default=2,
                        help="also run the most workers with this many writers (default 2; 1: no such run)")
    parser.add_argument("--bucket-size", default="256MiB", help="rayexport --bucket-size (default 256MiB)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "rayexport-bench"))
    parser.add_argument("--skip-verl", action="store_true")
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--transport-mb", type=int, default=256, help="buffer size of the transport comparison")
    parser.add_argument("--startup-exports", type=int, default=3, help="exports in a row for the warm-pool comparison")
    parser.add_argument("--verify", default="none", help="rayexport --verify levels, each run for every worker count (default none)")
    parser.add_argument("--json", metavar="PATH", help="also write every measurement as JSON")
    parser.add_argument("--plots", metavar="DIR", default=DOCS_IMAGES, help="where the size plot goes (default docs/images)")
    parser.add_argument("--replot", metavar="JSON", help="only draw the plot again from a run's --json")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as handle:
            print("plot:", plot_sizes([Run(**run) for run in json.load(handle)["runs"]], args))
        return 0
    sizes = [size.strip() for size in args.sizes.split(",") if size.strip()]
    worker_counts = [int(count) for count in args.workers.split(",")]
    levels = [level.strip() for level in args.verify.split(",") if level.strip()]
    configurations = [(workers, 1, level) for level in levels for workers in worker_counts]
    if args.writers > 1:
        configurations += [(max(worker_counts), args.writers, level) for level in levels]
    report_path = os.path.join(args.workdir, "report.json")
    os.makedirs(args.workdir, exist_ok=True)

    import ray
    import s3fs

    server, endpoint = (None, None) if args.skip_s3 else start_moto()
    os.environ.update(S3_ENV, **({"AWS_ENDPOINT_URL": endpoint} if endpoint else {}))
    s3 = s3fs.S3FileSystem(endpoint_url=endpoint, key=S3_ENV["AWS_ACCESS_KEY_ID"], secret=S3_ENV["AWS_SECRET_ACCESS_KEY"]) if endpoint else None
    started = time.perf_counter()
    ray.init(num_cpus=max(worker_counts) + 1, include_dashboard=False, logging_level="WARNING")
    ray_start_s = time.perf_counter() - started
    # after ray.init, which sets what a client needs to join (the token auth mode)
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    runs: list[Run] = []
    try:
        transport = transport_bench(args.transport_mb, repeats=4)
        warmed = False
        for size in sizes:
            config = sized_llama_config(parse_size(size))
            src = os.path.join(args.workdir, f"ckpt-{size}", "global_step_1", "actor")
            if not os.path.exists(os.path.join(src, "fsdp_config.json")):
                print(f"writing a {size} checkpoint ({config.num_hidden_layers} layers) to {src}", flush=True)
                shutil.rmtree(os.path.dirname(os.path.dirname(src)), ignore_errors=True)
                write_synthetic_checkpoint(config, src, args.world_size)
            nbytes = sum(os.path.getsize(os.path.join(src, name)) for name in os.listdir(src) if name.endswith(".pt"))
            out = os.path.join(args.workdir, "out")
            if not warmed:  # both tools warm: each command once, unmeasured (imports compiled, files cached)
                print("warming both tools: one unmeasured run of each", flush=True)
                if not args.skip_verl:
                    verl_merge(src, out, env)
                    remove(out, s3)
                rayexport_run(src, out, worker_counts[0], 1, args.bucket_size, env, report_path, levels[-1])
                remove(out, s3)
                warmed = True

            remove(out, s3)
            floor_s, _ = measure(["cp", "-r", src, out])
            runs.append(Run(size, "floor: cp -r (local)", floor_s, export_s=floor_s, nbytes=nbytes))
            remove(out, s3)

            verl_s = None
            if not args.skip_verl:
                verl_s, verl_rss = verl_merge(src, out, env)
                runs.append(Run(size, "verl model_merger (local)", verl_s, export_s=verl_s, peak_rss={"merger": verl_rss},
                                floor_s=floor_s, nbytes=nbytes))
                remove(out, s3)

            for workers, writers, level in configurations:
                wall, report = rayexport_run(src, out, workers, writers, args.bucket_size, env, report_path, level)
                runs.append(_rayexport_row(size, _label(workers, writers, level, "local"), wall, report, floor_s, verl_s, nbytes))
                remove(out, s3)

            if s3 is not None:
                s3_src, s3_out = f"s3://{BUCKET}/ckpt-{size}/actor", f"s3://{BUCKET}/out"
                remove(s3_src, s3)
                started = time.perf_counter()
                s3.put(src, s3_src, recursive=True)
                s3_floor_s = time.perf_counter() - started
                runs.append(Run(size, "floor: s3fs put (S3)", s3_floor_s, export_s=s3_floor_s, nbytes=nbytes))
                for workers, writers, level in configurations:
                    wall, report = rayexport_run(s3_src, s3_out, workers, writers, args.bucket_size, env, report_path, level)
                    runs.append(_rayexport_row(size, _label(workers, writers, level, "S3"), wall, report, s3_floor_s, None, nbytes))
                    remove(s3_out, s3)
                remove(s3_src, s3)
        first = os.path.join(args.workdir, f"ckpt-{sizes[0]}", "global_step_1", "actor")
        startup = startup_bench(first, os.path.join(args.workdir, "startup"), max(worker_counts), args.startup_exports)
    finally:
        ray.shutdown()
        if server is not None:
            server.terminate()
    print_tables(runs, ray_start_s, transport, startup, args)
    print("\nplot:", plot_sizes(runs, args))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"ray_start_s": ray_start_s, "transport_mb_s": transport, "startup_s": startup,
                       "runs": [run.__dict__ for run in runs]}, handle, indent=2)
    return 0


def verl_merge(src: str, out: str, env: dict[str, str]) -> tuple[float, int]:
    """verl's merger on the checkpoint at `src`, as its users run it: wall seconds and peak RSS."""
    command = [verl_python(), "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", src, "--target_dir", out]
    return measure(command, dict(env, CUDA_VISIBLE_DEVICES=""))


def _label(workers: int, writers: int, verify: str, storage: str) -> str:
    return (f"rayexport {workers} worker(s)" + (f", {writers} writers" if writers > 1 else "")
            + f", --verify {verify} ({storage})")


def plot_sizes(runs: list[Run], args) -> str:
    """docs' picture of the local runs: wall time and the largest process against checkpoint
    size, for the floor (cp -r), verl's merger and each rayexport configuration."""
    points = [
        SizePoint(run.name.removesuffix(" (local)"), run.nbytes, run.wall_s, max(run.peak_rss.values()) if run.peak_rss else None)
        for run in runs if run.name.endswith("(local)")
    ]
    title = f"local disk, world size {args.world_size}, bf16, --bucket-size {args.bucket_size}, both tools warm, Ray joined"
    return size_plot(points, os.path.join(args.plots, "export-vs-size.png"), title)


def _rayexport_row(size: str, name: str, wall: float, report: dict, floor_s: float, verl_s: float | None, nbytes: int) -> Run:
    seconds = report["seconds"]
    export_s = sum(value for stage, value in seconds.items() if stage != "start_workers")
    return Run(size, name, wall, export_s=export_s, start_s=seconds.get("start_workers"), stages=seconds,
               peak_rss=report["peak_rss_bytes"], floor_s=floor_s, verl_s=verl_s, nbytes=nbytes)


def print_tables(runs: list[Run], ray_start_s: float, transport: dict[str, float], startup: dict[str, list[float]], args) -> None:
    print(f"\nmachine: {os.cpu_count()} CPUs; bucket size {args.bucket_size}; world size {args.world_size}; "
          f"rayexport with --verify none; page cache warm")
    print(f"Ray start-up (ray.init of a local instance, once for every rayexport run): {ray_start_s:.1f} s\n")
    print("| size | run | wall s | export s | actor start s | x floor | x verl | MB/s | peak RSS MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for run in runs:
        ratio_floor = f"{run.export_s / run.floor_s:.2f}" if run.floor_s else ""
        ratio_verl = f"{run.wall_s / run.verl_s:.2f}" if run.verl_s else ""
        rss = ", ".join(f"{name} {value / MiB:.0f}" for name, value in (run.peak_rss or {}).items())
        start = f"{run.start_s:.1f}" if run.start_s is not None else ""
        print(f"| {run.size} | {run.name} | {run.wall_s:.1f} | {run.export_s:.1f} | {start} | {ratio_floor} | "
              f"{ratio_verl} | {run.nbytes / run.export_s / 1e6:.0f} | {rss} |")
    print("\nexport s: rayexport's plan + load + transfer + commit stages (no Ray or actor start-up); "
          "x floor: export s / the floor's seconds on the same storage; x verl: wall / verl's wall, both warm.")
    print(f"\nworker start-up (actors and process group) for {args.startup_exports} exports in a row of the "
          f"{args.sizes.split(',')[0]} checkpoint with export_remote, {max(int(c) for c in args.workers.split(','))} workers:")
    for label, values in startup.items():
        print(f"  {label}: " + ", ".join(f"{value:.2f} s" for value in values))
    print(f"\ngather transport on this node ({args.transport_mb} MiB buffer, 4 times):")
    for name, rate in transport.items():
        print(f"  {name}: {rate:.0f} MB/s")


if __name__ == "__main__":
    sys.exit(main())
