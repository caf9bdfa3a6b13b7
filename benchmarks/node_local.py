"""A checkpoint on node-local disks against the same checkpoint in one folder, on one two-node Ray
cluster (each node's `ray start` in a mount namespace of its own: tests/support/node_cluster.py).

    python benchmarks/node_local.py                 # 400 MB bfloat16 Llama, world size 4, verl and DCP
    python benchmarks/node_local.py --mb 100 --rounds 2

One invocation writes each checkpoint once with FSDP2 gloo ranks, copies ranks 0-1 (and
`huggingface/`, `fsdp_config.json`, `.metadata`) to node A's disk and ranks 2-3 to node B's, and
then exports, alternating: from the two disks, and from one folder both nodes see; each run is
the CLI as a user runs it (`--verify full`, local --dst, 2 workers), after one warm-up export of
each kind. It prints a markdown table of wall seconds and the export's stages; nothing here
asserts a number. Needs root (mount namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # support: the tests' checkpoint writers and node cluster

from support.checkpoints import write_synthetic_checkpoint  # noqa: E402
from support.models import sized_llama_config  # noqa: E402
from support.node_cluster import NodeCluster, mount_namespaces_refused  # noqa: E402

WORLD = 4


def split(whole: str, disk_a: str, disk_b: str, layout: str) -> None:
    """Node A: ranks 0-1 and the small files; node B: ranks 2-3."""
    for name in os.listdir(whole):
        rank = name.removeprefix("__").split("_")[0] if layout == "dcp" else name.rsplit("_", 1)[-1].split(".")[0]
        on_b = rank.isdigit() and int(rank) >= WORLD // 2 and name.endswith((".pt", ".distcp"))
        target = os.path.join(disk_b if on_b else disk_a, layout)
        os.makedirs(target, exist_ok=True)
        copy = shutil.copytree if os.path.isdir(os.path.join(whole, name)) else shutil.copy2
        copy(os.path.join(whole, name), os.path.join(target, name))


def export(cluster: NodeCluster, src: str, dst: str) -> tuple[float, dict]:
    shutil.rmtree(dst, ignore_errors=True)
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "rayexport.run", "--src", src, "--dst", dst, "--workers", "2", "--report", "-"],
        capture_output=True, text=True, env=cluster.env,
    )
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        raise RuntimeError(completed.stderr[-3000:])
    report = json.loads(completed.stdout[completed.stdout.index("\n{") + 1:])
    return wall, report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=400, help="checkpoint size in MB (bfloat16)")
    parser.add_argument("--rounds", type=int, default=2, help="measured exports of each kind")
    args = parser.parse_args()
    refused = mount_namespaces_refused()
    if refused:
        print(f"cannot run: {refused}", file=sys.stderr)
        return 1
    root = tempfile.mkdtemp(prefix="rayexport-node-local-")
    disk_a, disk_b = os.path.join(root, "disk-a"), os.path.join(root, "disk-b")
    config = sized_llama_config(args.mb * 10**6)
    sizes = {}
    for layout in ("verl", "dcp"):
        whole = os.path.join(root, f"whole-{layout}")
        sizes[layout] = write_synthetic_checkpoint(config, whole, world_size=WORLD, layout=layout)
        split(whole, disk_a, disk_b, layout)
    cluster = NodeCluster(os.path.join(root, "view"), [disk_a, disk_b]).start()
    rows = []
    try:
        for layout in ("verl", "dcp"):
            sources = {"two node-local disks": f"{cluster.view}/{layout}", "one folder": os.path.join(root, f"whole-{layout}")}
            for kind, src in sources.items():  # warm-up: first imports, first actors on each node
                export(cluster, src, os.path.join(root, "out"))
            for round_ in range(args.rounds):
                for kind, src in sources.items():
                    wall, report = export(cluster, src, os.path.join(root, "out"))
                    nodes = len({where["node"] for where in report["placement"].values()})
                    stages = ", ".join(f"{name} {seconds:.1f}" for name, seconds in report["seconds"].items())
                    rows.append((layout, kind, round_ + 1, wall, nodes, stages))
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.mb} MB bfloat16 Llama, world size {WORLD} (verl {sizes['verl'] / 1e6:.0f} MB, DCP {sizes['dcp'] / 1e6:.0f} MB), "
          "2 workers, --verify full, local --dst\n")
    print("| layout | source | round | wall s | nodes read on | stages (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for layout, kind, round_, wall, nodes, stages in rows:
        print(f"| {layout} | {kind} | {round_} | {wall:.1f} | {nodes} | {stages} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
