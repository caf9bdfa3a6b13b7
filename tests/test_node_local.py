"""Checkpoints on node-local disks: a real two-node Ray cluster on this machine where each node
sees its own folder at the same path (support/node_cluster.py: a mount namespace per node), as
verl leaves a multi-node run without a shared filesystem. Node A holds ranks 0-1, `huggingface/`
and `fsdp_config.json`; node B ranks 2-3. Exports run as a user runs them: the CLI, joined to
that cluster through RAY_ADDRESS.

The verl and the DCP checkpoint hold the same model, so one export from a folder both nodes see
is what either, split over the nodes, must export byte for byte."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rayexport.layouts.verl import rank_file_name
from support.helpers import exported_tensors
from support.node_cluster import NodeCluster, mount_namespaces_refused

REFUSED = mount_namespaces_refused()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REFUSED is not None, reason=REFUSED or "")]

WORLD = 4
# A dense tied model (its in-memory names are its on-disk ones), both layouts written by one set of ranks.
MODEL = "qwen3"
NODE_A = ["huggingface", "fsdp_config.json", rank_file_name(WORLD, 0), rank_file_name(WORLD, 1)]
NODE_B = [rank_file_name(WORLD, 2), rank_file_name(WORLD, 3)]
DCP_A = ["huggingface", ".metadata", "__0_0.distcp", "__1_0.distcp"]
DCP_B = ["__2_0.distcp", "__3_0.distcp"]
# A Megatron-LM save of tensor parallel 2 (support/megatron_checkpoints.py): its tracker, config and
# metadata with TP rank 0's files on node A, TP rank 1's on node B. Each file holds a chunk of
# every layer of each stacked tensor.
MEGATRON = "llama-tp2-untied-megatron-lm"
ITERATION = "iter_0000002"
MEGATRON_A = ["latest_checkpointed_iteration.txt", *(f"{ITERATION}/{name}" for name in (
    ".metadata", "metadata.json", "common.pt", "__0_0.distcp", "__0_1.distcp"))]
MEGATRON_B = [f"{ITERATION}/__1_0.distcp", f"{ITERATION}/__1_1.distcp"]
# A DeepSpeed ZeRO-3 save of 3 ranks in Trainer's layout (support/deepspeed_checkpoints.py): rank 0's
# files, `latest` and the config on node A, ranks 1 and 2's on node B. The driver reads each rank's
# record from the node that holds it; each worker maps its own node's fp32 buffers.
DEEPSPEED = "zero3-untied-world3-two-groups"
DEEPSPEED_RANK_FILES = ["global_step2/zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                        "global_step2/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]


def _copy(source: str, names: list[str], target: str) -> None:
    for name in names:
        os.makedirs(os.path.dirname(os.path.join(target, name)), exist_ok=True)
        copy = shutil.copytree if os.path.isdir(os.path.join(source, name)) else shutil.copy2
        copy(os.path.join(source, name), os.path.join(target, name))


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, megatron_checkpoints, deepspeed_checkpoints):
    """The two-node cluster, and the checkpoints of one model: each whole in one folder both
    nodes see (`whole`), and split between the nodes' own folders under `view`; a Megatron-LM
    and a DeepSpeed save split the same way."""
    from support.checkpoints import write_format_checkpoints

    root = tmp_path_factory.mktemp("node-local")
    written = write_format_checkpoints(str(root / "whole"), [(MODEL, "in-memory", layout) for layout in ("verl", "dcp")], WORLD)
    whole = {layout: checkpoint.path for (_, _, layout), checkpoint in written.items()}
    disk_a, disk_b = root / "disk-a", root / "disk-b"
    _copy(whole["verl"], NODE_A, str(disk_a / "verl"))
    _copy(whole["verl"], NODE_B, str(disk_b / "verl"))
    _copy(whole["dcp"], DCP_A, str(disk_a / "dcp"))
    _copy(whole["dcp"], DCP_B, str(disk_b / "dcp"))
    megatron = megatron_checkpoints[MEGATRON]
    _copy(megatron, MEGATRON_A, str(disk_a / "megatron"))
    shutil.copytree(os.path.join(megatron, "hf"), disk_a / "megatron" / "huggingface")  # found beside the tracker
    _copy(megatron, MEGATRON_B, str(disk_b / "megatron"))
    deepspeed = os.path.join(deepspeed_checkpoints[DEEPSPEED], "checkpoint-2")
    rank_files = {name.format(rank=rank) for name in DEEPSPEED_RANK_FILES for rank in range(3)}
    on_a = [name for name in os.listdir(deepspeed) if name != "global_step2"] + [name.format(rank=0) for name in DEEPSPEED_RANK_FILES]
    assert rank_files == set(os.path.join("global_step2", name) for name in os.listdir(os.path.join(deepspeed, "global_step2")))
    _copy(deepspeed, on_a, str(disk_a / "deepspeed"))
    _copy(deepspeed, sorted(rank_files - set(on_a)), str(disk_b / "deepspeed"))
    _copy(whole["verl"], NODE_A[:3], str(disk_a / "verl-missing"))  # rank 1 on no node, nor rank 3
    _copy(whole["verl"], NODE_B[:1], str(disk_b / "verl-missing"))
    _copy(whole["verl"], NODE_A + NODE_B[:1], str(disk_a / "verl-differs"))
    _copy(whole["verl"], NODE_B, str(disk_b / "verl-differs"))
    with open(disk_b / "verl-differs" / NODE_B[0], "ab") as handle:
        handle.write(b"one more write on node B")  # rank 2's file is not the same on both nodes
    # 4 CPUs a node: two exports of 4 workers (2 on each node) run at once (`runs`).
    cluster = NodeCluster(str(root / "view"), [str(disk_a), str(disk_b)], num_cpus=4).start()
    try:
        yield {"cluster": cluster, "whole": whole, "view": cluster.view, "disks": (str(disk_a), str(disk_b)), "root": root,
               "megatron": megatron, "deepspeed": deepspeed_checkpoints[DEEPSPEED]}
    finally:
        cluster.stop()


def run_export(cluster: NodeCluster, *args: str) -> tuple[subprocess.CompletedProcess, dict | None, float]:
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "rayexport.run", *args, "--report", "-"],
        capture_output=True, text=True, timeout=400, env=cluster.env,
    )
    seconds = time.perf_counter() - started
    report = None
    if completed.returncode == 0:
        report = json.loads(completed.stdout[completed.stdout.index("\n{") + 1:])
    return completed, report, seconds


REMOTE = """
import dataclasses, json, sys
import ray
from rayexport import export_remote

ray.init(logging_level="WARNING")
report = ray.get(export_remote(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3]))
print("REPORT " + json.dumps(dataclasses.asdict(report)))
"""


def run_export_remote(
    cluster: NodeCluster, src: str, dst: str, max_shard_size: str
) -> tuple[subprocess.CompletedProcess, dict | None, float]:
    """`export_remote()` from a driver of the cluster, as an RL loop calls it after a checkpoint."""
    started = time.perf_counter()
    command = [sys.executable, "-c", REMOTE, src, dst, max_shard_size]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=400, env=cluster.env)
    seconds = time.perf_counter() - started
    lines = [line for line in completed.stdout.splitlines() if line.startswith("REPORT ")]
    return completed, json.loads(lines[0].removeprefix("REPORT ")) if lines else None, seconds


def safetensors_bytes(folder: str) -> dict[str, bytes]:
    found = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            with open(os.path.join(folder, name), "rb") as handle:
                found[name] = handle.read()
    return found


# Small shards, so that two writers have files to share and the byte comparison covers an index.
SHARD_SIZE = "100KB"
SHARDS = ("--max-shard-size", SHARD_SIZE)


@pytest.fixture(scope="module")
def runs(nodes):
    """Every export this module checks, by name: the completed process, its report and its
    seconds. They run two at a time, since on a machine of few cores one export leaves them
    idle much of its time.

    `one-folder`: the verl checkpoint from the folder both nodes see, to a destination path
    under which each node has a disk of its own, with two writers. `split-verl` (the CLI) and
    `split-dcp` (`export_remote()`): each layout from its files split between the nodes.
    `missing`, `differs`: the CLI on checkpoints no export may start from."""
    cluster, view, root = nodes["cluster"], nodes["view"], nodes["root"]
    started = {
        "one-folder": lambda: run_export(
            cluster, "--src", nodes["whole"]["verl"], "--dst", f"{view}/out", "--workers", "2", "--writers", "2", *SHARDS),
        "split-verl": lambda: run_export(cluster, "--src", f"{view}/verl", "--dst", str(root / "split-verl"), *SHARDS),
        "split-dcp": lambda: run_export_remote(cluster, f"{view}/dcp", str(root / "split-dcp"), SHARD_SIZE),
        "split-megatron": lambda: run_export(
            cluster, "--src", f"{view}/megatron", "--dst", str(root / "split-megatron"), "--dtype", "float32"),
        "split-deepspeed": lambda: run_export(
            cluster, "--src", f"{view}/deepspeed", "--dst", str(root / "split-deepspeed"), "--dtype", "float32"),
        "dry-run-dcp": lambda: run_export(cluster, "--src", f"{view}/dcp", "--dst", str(root / "dry-run"), *SHARDS, "--dry-run"),
        "dry-run-verl": lambda: run_export(cluster, "--src", f"{view}/verl", "--dst", str(root / "dry-run"), "--dry-run"),
        "missing": lambda: run_export(cluster, "--src", f"{view}/verl-missing", "--dst", str(root / "missing")),
        "differs": lambda: run_export(cluster, "--src", f"{view}/verl-differs", "--dst", str(root / "differs")),
    }
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(run) for name, run in started.items()}
    return {name: future.result() for name, future in futures.items()}


def holding(nodes, name: str) -> list[str]:
    """The disks' folders that hold the export to `view`/`name`."""
    return [os.path.join(disk, name) for disk in nodes["disks"] if os.path.exists(os.path.join(disk, name))]


@pytest.mark.parametrize("layout", ["verl", "dcp"])
def test_a_checkpoint_no_node_holds_whole_exports_the_same_bytes_as_from_one_folder(nodes, runs, layout):
    """verl's rank files through the CLI; DCP's `.distcp` files (`.metadata` on node A only)
    through `export_remote()`, whose export runs in a Ray task on either node. Both against the
    model's export from the verl checkpoint's one folder."""
    split, split_report, split_s = runs[f"split-{layout}"]
    whole, _, whole_s = runs["one-folder"]
    assert split.returncode == 0 and split_report is not None, split.stderr[-4000:]
    assert whole.returncode == 0, whole.stderr[-4000:]
    print(f"{layout}: split over two nodes {split_s:.1f} s, from one folder {whole_s:.1f} s")

    assert split_report["verification"]["passed"] and split_report["verification"]["level"] == "full"
    assert "reload" in split_report["verification"]["checks"]
    nodes_used = {where["node"] for where in split_report["placement"].values()}
    assert len(nodes_used) == 2, split_report["placement"]  # each node's files read there
    if layout == "verl":  # the CLI's log says, per node, what it reads and which worker
        reading = re.findall(r"rayexport.orchestration.group: node (.+): worker\(s\) ([\d, ]+) read (.+)", split.stderr)
        assert len(reading) == 2, split.stderr[-3000:]
    exported = safetensors_bytes(str(nodes["root"] / f"split-{layout}"))
    assert exported and exported == safetensors_bytes(holding(nodes, "out")[0])


def assert_split_export_equals(nodes, runs, layout: str, reported_layout: str, reference: str) -> None:
    """The CLI's export of `layout`'s save split over the nodes: verified in full, read on both
    nodes, and equal tensor for tensor to its producer's own conversion (`reference`, under the save)."""
    from safetensors.torch import load_file

    completed, report, _ = runs[f"split-{layout}"]
    assert completed.returncode == 0 and report is not None, completed.stderr[-4000:]
    assert report["layout"] == reported_layout and report["verification"]["level"] == "full"
    assert len({where["node"] for where in report["placement"].values()}) == 2, report["placement"]
    exported = exported_tensors(str(nodes["root"] / f"split-{layout}"))
    expected = load_file(os.path.join(nodes[layout], "reference", reference))
    assert set(exported) == set(expected)
    assert all(exported[key].equal(tensor) for key, tensor in expected.items())


def test_a_megatron_save_no_node_holds_whole_exports_what_mbridge_exports(nodes, runs):
    """Each worker reads its own node's `.distcp` files, every chunk of every layer in them."""
    assert_split_export_equals(nodes, runs, "megatron", "megatron", "mbridge.safetensors")


def test_a_deepspeed_save_no_node_holds_whole_exports_deepspeeds_own_conversion(nodes, runs):
    """Each worker maps the fp32 buffers of its own node's optimizer states files."""
    assert_split_export_equals(nodes, runs, "deepspeed", "deepspeed-zero3", "zero_to_fp32.safetensors")


def test_a_dry_run_places_the_workers_on_the_nodes_as_the_export_then_does(nodes, runs):
    """`--dry-run` joined to the cluster, on the DCP save split over the nodes: the workers are
    placed by the files each node holds, and the plan is the one `export_remote` then ran (its
    report's estimate). A verl save split so is refused in one line: its shapes are in rank files
    only the workers on their nodes read."""
    completed, dry, _ = runs["dry-run-dcp"]
    assert completed.returncode == 0 and dry is not None, completed.stderr[-4000:]
    _, exported, _ = runs["split-dcp"]
    cost = dry["cost"]
    assert len({worker["node"] for worker in cost["workers"]}) == 2 and "nothing written" in completed.stdout
    assert exported is not None and exported["estimate"] == cost
    assert not os.path.exists(nodes["root"] / "dry-run")
    refused, _, _ = runs["dry-run-verl"]
    lines = [line for line in refused.stderr.splitlines() if line.startswith("rayexport: error:")]
    assert refused.returncode == 1 and len(lines) == 1 and "holds on the cluster's nodes' own disks" in lines[0], refused.stderr[-3000:]


def test_ranks_on_no_node_are_one_line_before_any_worker_starts(nodes, runs):
    completed, _, _ = runs["missing"]
    assert completed.returncode == 1
    lines = [line for line in completed.stderr.splitlines() if line.startswith("rayexport: error:")]
    assert len(lines) == 1, completed.stderr[-3000:]
    assert lines[0].startswith("rayexport: error: rank files 1, 3 of world size 4 are on no node of this cluster (asked 2 nodes: ")
    assert "worker(s) over" not in completed.stderr  # no worker group was sized, let alone started
    assert not os.path.exists(nodes["root"] / "missing")


def test_a_file_whose_size_differs_between_nodes_is_one_line_naming_both(runs):
    completed, _, _ = runs["differs"]
    assert completed.returncode == 1
    lines = [line for line in completed.stderr.splitlines() if line.startswith("rayexport: error:")]
    assert len(lines) == 1 and re.fullmatch(
        r"rayexport: error: '.*/verl-differs/model_world_size_4_rank_2.pt' differs between nodes: "
        r"\d+ bytes on .+, \d+ bytes on .+", lines[0]
    ), completed.stderr[-3000:]
    assert "worker(s) over" not in completed.stderr


def test_a_local_destination_on_two_nodes_is_written_whole_on_one(nodes, runs):
    """`--writers 2` with a destination path every node has a disk of its own under: the whole
    export, its manifest and its reload on one node."""
    completed, report, _ = runs["one-folder"]
    written_on = holding(nodes, "out")
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert report["export_node"] and f"on node {report['export_node']}" in completed.stdout
    assert report["verification"]["passed"] and "reload" in report["verification"]["checks"]
    assert len(written_on) == 1, written_on
    written = set(os.listdir(written_on[0]))
    assert "export_manifest.json" in written and set(report["files"]) <= written
    assert len([worker for worker, files in report["files_by_worker"].items() if files]) == 2  # both writers wrote
