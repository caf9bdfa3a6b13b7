"""Scale: every rayexport process's memory, verification and start-up, against verl's model
merger and the storage floor, side by side in one invocation.

    python benchmarks/scale_bench.py                          # 2.4 GB: both layouts, local and S3
    python benchmarks/scale_bench.py --big 28GB --skip-small  # a checkpoint larger than memory

On synthetic FSDP2 checkpoints (real DTensor rank files, or a real DCP checkpoint, written by
gloo ranks; a Llama config sized to the target, bf16, world size 4) it times:
  - the floor: `cp -r` (local) and s3fs `put` (S3) of the checkpoint;
  - verl's merger (benchmarks/.venv-verl, as export_bench.py makes it), verl layout, local; at
    the big size only inside a cgroup-v1 memory cap, so that its failure cannot take the
    machine down;
  - `python -m rayexport.run` as a user runs it, starting its own Ray (so the wall includes
    Ray's start), at each --verify level.
Both tools are warm: verl's merger and one rayexport export of each layout run once, unmeasured,
before the measured runs.
For rayexport it reports each process's peak above its start-up footprint (workers: above what
they held before loading; the reload check's process: above what it held once its imports were
done) against the bound 2 x --bucket-size + 1 GiB. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from export_bench import BUCKET, S3_ENV, measure, measure_capped, parse_size, remove, start_moto, verl_python  # puts tests/ on sys.path

from support.checkpoints import write_synthetic_checkpoint
from support.models import sized_llama_config

GiB = 2**30


def checkpoint(workdir: str, size: str, layout: str, one_rank_at_a_time: bool, conditioned: bool = False) -> tuple[str, int]:
    """The synthetic checkpoint of `size` in `layout` (made once, kept in `workdir`; see
    `write_synthetic_checkpoint` for `conditioned`); its path and the bytes of its rank files."""
    folder = f"ckpt-{size}-{layout}" + ("-conditioned" if conditioned else "")
    src = os.path.join(workdir, folder, "global_step_1", "actor")
    done = os.path.join(os.path.dirname(src), ".complete")
    if not os.path.exists(done):
        shutil.rmtree(os.path.dirname(os.path.dirname(src)), ignore_errors=True)
        config = sized_llama_config(parse_size(size))
        print(f"writing a {size} {layout} checkpoint ({config.num_hidden_layers} layers) to {src}", flush=True)
        write_synthetic_checkpoint(config, src, 4, layout=layout, one_rank_at_a_time=one_rank_at_a_time, conditioned=conditioned)
        open(done, "w").close()
    suffix = ".distcp" if layout == "dcp" else ".pt"
    return src, sum(os.path.getsize(os.path.join(src, name)) for name in os.listdir(src) if name.endswith(suffix))


def rayexport(src: str, dst: str, verify: str, bucket_size: str, report_path: str, env: dict) -> dict:
    """One export through the CLI, starting its own Ray; its wall seconds and report."""
    command = [
        sys.executable, "-m", "rayexport.run", "--src", src, "--dst", dst, "--workers", "4", "--verify", verify,
        "--bucket-size", bucket_size, "--report", report_path, "--log-level", "WARNING",
        "--num-cpus-per-worker", "0.25",  # four workers on this 2-core machine's own Ray
    ]
    wall, driver_rss = measure(command, env)
    with open(report_path) as handle:
        report = json.load(handle)
    return {"wall_s": wall, "report": report}


def peaks_above_start(report: dict) -> dict[str, int]:
    """Each process's peak above its start-up footprint, as the report gives them (workers,
    the reload check's process)."""
    return {name: size for name, size in report["working_memory_bytes"].items() if size is not None}


def verl_capped(src: str, out: str, cap_bytes: int | None) -> dict:
    """verl's merger, inside a cgroup-v1 memory cap when `cap_bytes` is given: its wall seconds,
    peak memory and whether it finished (an over-cap run is killed by the kernel)."""
    command = [verl_python(), "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", src, "--target_dir", out]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    if cap_bytes is None:
        wall, rss = measure(command, env)
        return {"wall_s": wall, "peak_rss_bytes": rss, "finished": True}
    wall, rss, code = measure_capped(command, env, cap_bytes)
    return {"wall_s": wall, "peak_rss_bytes": rss, "finished": code == 0, "exit": code}


def stages_s(report: dict) -> float:
    """The export's own stages: load, transfer, verification (files and reload), commit."""
    return sum(report["seconds"].get(name, 0.0) for name in ("load", "transfer", "verify_files", "reload", "commit"))


def row(label: str, run: dict, bound: int, verl_s: float | None, floor_s: float | None) -> str:
    report = run["report"]
    peaks = peaks_above_start(report)
    largest = max(peaks, key=peaks.get)
    seconds = report["seconds"]
    cells = [
        label, f"{run['wall_s']:.1f}", f"{stages_s(report):.1f}",
        f"{seconds.get('load', 0) + seconds.get('transfer', 0):.1f}",
        f"{seconds.get('verify_files', 0):.1f} + {seconds.get('reload', 0):.1f}",
        report["verification"].get("checks", {}).get("reload", {}).get("mode", "-"),
        f"{peaks[largest] / 2**20:.0f} MiB ({largest})", "yes" if peaks[largest] <= bound else "NO",
        f"{run['wall_s'] / verl_s:.2f}x / {stages_s(report) / verl_s:.2f}x" if verl_s else "-",
        f"{stages_s(report) / floor_s:.2f}x" if floor_s else "-",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| run | wall s | stages s | load+transfer s | verify files + reload s | reload | largest peak above start-up "
    "| within bound | vs verl (wall / stages) | stages vs floor |\n|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2.4GB", help="the side-by-side checkpoint size (default 2.4GB)")
    parser.add_argument("--big", help="also a checkpoint this large, verl layout, --verify full (e.g. 28GB)")
    parser.add_argument("--bucket-size", default="128MB")
    parser.add_argument("--verl-cap", default="22GiB", help="verl's memory cap at the big size")
    parser.add_argument("--workdir", default=os.path.join("/var/tmp", "rayexport-scale-bench"))
    parser.add_argument("--skip-small", action="store_true")
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--skip-local", action="store_true", help="of the side-by-side size, only the S3 rows")
    parser.add_argument("--skip-verl", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="also write every measurement as JSON")
    args = parser.parse_args(argv)
    bound = 2 * parse_size(args.bucket_size) + GiB
    os.makedirs(args.workdir, exist_ok=True)
    report_path, out = os.path.join(args.workdir, "report.json"), os.path.join(args.workdir, "out")
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    lines, measured = [HEADER], {}

    if not args.skip_small and not args.skip_local:
        verl_s = None
        src, nbytes = checkpoint(args.workdir, args.size, "verl", False)
        remove(out, None)
        floor_s, _ = measure(["cp", "-r", src, out])
        lines.append(f"| floor: cp -r, {nbytes / 1e9:.2f} GB | {floor_s:.1f} | | | | | | | | |")
        remove(out, None)
        if not args.skip_verl:
            verl_capped(src, out, None)  # unmeasured: verl warm, as rayexport is after its first run below
            remove(out, None)
            verl = verl_capped(src, out, None)
            verl_s = measured["verl"] = verl["wall_s"]
            lines.append(f"| verl model_merger | {verl_s:.1f} | | | | | {verl['peak_rss_bytes'] / 2**20:.0f} MiB (merger) | | | |")
            remove(out, None)
        for layout in ("verl", "dcp"):
            src, _ = checkpoint(args.workdir, args.size, layout, False)
            rayexport(src, out, "quick", args.bucket_size, report_path, env)  # unmeasured: warm imports, page cache
            remove(out, None)
            for verify in ("none", "quick", "full"):
                run = measured[f"{layout}-{verify}"] = rayexport(src, out, verify, args.bucket_size, report_path, env)
                lines.append(row(f"rayexport {layout} local, --verify {verify}", run, bound, verl_s, None))
                remove(out, None)
    if not args.skip_small and not args.skip_s3:
        lines += s3_rows(args, bound, measured, env, report_path)

    if args.big:
        src, nbytes = checkpoint(args.workdir, args.big, "verl", True)
        remove(out, None)
        run = measured["big-full"] = rayexport(src, out, "full", args.bucket_size, report_path, env)
        lines.append(row(f"rayexport verl local {nbytes / 1e9:.1f} GB, --verify full", run, bound, None, None))
        remove(out, None)
        if not args.skip_verl:
            verl = measured["big-verl"] = verl_capped(src, out, parse_size(args.verl_cap))
            outcome = "finished" if verl["finished"] else f"killed at the {args.verl_cap} cap (exit {verl['exit']})"
            lines.append(f"| verl model_merger {nbytes / 1e9:.1f} GB | {verl['wall_s']:.1f} | | | | {outcome} "
                         f"| {verl['peak_rss_bytes'] / 2**20:.0f} MiB (merger) | | | |")
            remove(out, None)

    print(f"\nbound: 2 x --bucket-size {args.bucket_size} + 1 GiB = {bound / 2**20:.0f} MiB above start-up")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(measured, handle, indent=2)
    return 0


def s3_rows(args, bound: int, measured: dict, env: dict, report_path: str) -> list[str]:
    """The same checkpoint S3 -> S3 through moto's server: s3fs `put` floor, then rayexport."""
    import s3fs

    server, endpoint = start_moto()
    s3_env = dict(env, **S3_ENV, AWS_ENDPOINT_URL=endpoint)
    s3 = s3fs.S3FileSystem(endpoint_url=endpoint, key=S3_ENV["AWS_ACCESS_KEY_ID"], secret=S3_ENV["AWS_SECRET_ACCESS_KEY"])
    lines = []
    try:
        src, nbytes = checkpoint(args.workdir, args.size, "verl", False)
        s3_src, s3_out = f"s3://{BUCKET}/ckpt/actor", f"s3://{BUCKET}/out"
        started = time.perf_counter()
        s3.put(src, s3_src, recursive=True)
        floor_s = time.perf_counter() - started
        lines.append(f"| floor: s3fs put, {nbytes / 1e9:.2f} GB | {floor_s:.1f} | | | | | | | | |")
        for verify in ("none", "quick", "full"):
            run = measured[f"s3-{verify}"] = rayexport(s3_src, s3_out, verify, args.bucket_size, report_path, s3_env)
            lines.append(row(f"rayexport verl S3 -> S3, --verify {verify}", run, bound, None, floor_s))
            remove(s3_out, s3)
    finally:
        server.terminate()
        server.wait()
    return lines


if __name__ == "__main__":
    sys.exit(main())
