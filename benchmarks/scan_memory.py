"""Memory of the tied-copy comparison, chunked, against upcasting both tensors whole.

    python benchmarks/scan_memory.py            # a 128 MiB float32 pair
    python benchmarks/scan_memory.py --mib 512

Each measurement runs in a fresh process and reports its peak RSS above the two tensors it
holds: the baseline upcasts both tensors to float64 whole (what the tie check did before it
was chunked); `rayexport.common.scan` goes a bounded chunk at a time. Nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

MEASURE = """
import resource, sys, time, torch
from rayexport.common.scan import max_abs_difference
elements = {mib} * 2**20 // 4
first = torch.randn(elements)
second = first + 0.25 if "{case}" == "differ" else first.clone()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
if "{method}" == "whole":
    (first.double() - second.double()).abs().max().item()
else:
    max_abs_difference(first, second)
seconds = time.perf_counter() - started
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024, seconds)
"""


def measure(mib: int, method: str, case: str) -> tuple[float, float]:
    """Peak MiB above the inputs, and seconds, of one comparison in a fresh process."""
    output = subprocess.run(
        [sys.executable, "-c", MEASURE.format(mib=mib, method=method, case=case)],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    return float(output[0]), float(output[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="size of each tensor of the pair (default 64)")
    args = parser.parse_args()
    print(f"| a {2 * args.mib} MiB float32 pair | peak above the inputs | seconds |")
    print("| --- | --- | --- |")
    for method, case in (("whole", "equal"), ("whole", "differ"), ("chunked", "equal"), ("chunked", "differ")):
        peak, seconds = measure(args.mib, method, case)
        print(f"| {method} float64 compare, copies {case} | {peak:.0f} MiB | {seconds:.2f} |")


if __name__ == "__main__":
    main()
