"""`--dry-run` through the command line, as a user runs it: the plan from metadata alone, nothing
written at DST, the same refusals as the export, and the same plan then driving a real export
whose report measures what the estimate said; and the plan of checkpoints of 235B and 70B
parameters whose bytes are holes (`support.sparse_megatron`)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from support.helpers import error_lines, run_main, s3_exists, upload
from support.sparse_megatron import QWEN3_235B_A22B, write_sparse_checkpoint, write_sparse_fsdp_dcp

pytestmark = pytest.mark.usefixtures("ray_address")


def _planned(tmp_path, *args: str) -> dict:
    report = tmp_path / "dry-run.json"
    completed = run_main(*args, "--dry-run", "--report", str(report))
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "nothing written" in completed.stdout and "estimated seconds" in completed.stdout
    return json.loads(report.read_text())


def _without_distcp_bytes(folder: str, copy) -> str:
    """A copy of a DCP checkpoint whose `.distcp` files are empty: only its metadata is left to read."""
    shutil.copytree(folder, copy)
    for name in os.listdir(copy):
        if name.endswith(".distcp"):
            open(os.path.join(copy, name), "w").close()
    return str(copy)


@pytest.mark.parametrize("name", ["dcp-s3", "verl-local"])
def test_the_dry_runs_plan_is_what_the_export_then_does(name, dcp_checkpoints, checkpoints, s3_prefix, tmp_path):
    """The dry run plans each worker's bytes and files; the export of the same options plans
    the same (its report's estimate) and then reads, gathers and writes exactly those bytes."""
    if name == "dcp-s3":
        source = upload(dcp_checkpoints["tied"].path, f"{s3_prefix}-src")
        planned_from = upload(_without_distcp_bytes(dcp_checkpoints["tied"].path, tmp_path / "metadata-only"), f"{s3_prefix}-meta")
        destination = f"{s3_prefix}-dst"
    else:
        source = planned_from = checkpoints["untied"].path
        destination = str(tmp_path / "export")
    _planned_then_exported(tmp_path, planned_from, source, destination, s3_exists if name == "dcp-s3" else os.path.exists)


@pytest.mark.parametrize("producer", ["megatron", "deepspeed"])
def test_the_dry_runs_plan_of_a_producers_own_save_is_what_the_export_then_does(
    producer, megatron_checkpoints, deepspeed_checkpoints, tmp_path,
):
    """A Qwen3-MoE save by Megatron-Core at EP2 (grouped experts, an optimizer beside them), read
    from `.metadata`, and a Mixtral save by DeepSpeed ZeRO-3 (fused experts flattened into runs
    over 3 ranks), read from the records that place each run."""
    from support import deepspeed_checkpoints as deepspeed, megatron_checkpoints as megatron

    if producer == "megatron":
        source, extra = megatron.source_of(megatron_checkpoints["qwen3_moe-ep2-grouped-bf16-optimizer"])
    else:
        source, extra = deepspeed.source_of(deepspeed_checkpoints["zero3-bf16-mixtral-world3-two-groups"])
    _planned_then_exported(tmp_path, source, source, str(tmp_path / "export"), os.path.exists, *extra)


def _planned_then_exported(tmp_path, planned_from: str, source: str, destination: str, exists, *extra: str) -> None:
    """Plan the export of `planned_from` (nothing at `destination` after it), export `source` with
    the same options, and check that the export planned the same and moved exactly those bytes."""
    options = ("--dst", destination, "--workers", "2", "--bucket-size", "64KiB", "--max-shard-size", "40KB", *extra)
    dry = _planned(tmp_path, "--src", planned_from, *options)
    assert not exists(destination)
    cost = dry["cost"]
    assert dry["workers"] == 2 and len(cost["workers"]) == 2 and cost["file_count"] > 1

    report_path = tmp_path / "report.json"
    completed = run_main("--src", source, *options, "--report", str(report_path))
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["estimate"] == cost  # the same plan
    workers = cost["workers"]
    assert report["bytes"]["read"] == sum(worker["bytes_read"] for worker in workers)
    assert report["bytes"]["gathered"] == sum(worker["bytes_received"] for worker in workers)
    for worker in workers:
        assert set(worker["files"]) <= set(report["files_by_worker"][f"worker{worker['worker']}"])
        assert worker["bytes_written"] == sum(report["files"][file]["size"] for file in worker["files"])
    assert cost["tensor_count"] == report["tensor_count"]
    assert "estimated seconds (measured): transfer" in completed.stdout


def test_the_dry_run_refuses_what_the_export_refuses(dcp_checkpoints, checkpoints, s3_endpoint, tmp_path):
    mismatched = shutil.copytree(dcp_checkpoints["flat"].path, tmp_path / "ckpt")
    shutil.rmtree(mismatched / "huggingface")
    shutil.copytree(dcp_checkpoints["tied"].path + "/huggingface", mismatched / "huggingface")
    in_s3 = upload(checkpoints["tied"].path, "s3://rayexport-tests/dry-run/verl-tied")
    cases = [
        (("--src", str(mismatched), "--dst", str(tmp_path / "out"), "--layout", "dcp"), "config"),
        (("--src", checkpoints["tied"].path, "--dst", checkpoints["tied"].path + "/export"), "is inside source"),
        (("--src", in_s3, "--dst", str(tmp_path / "out")), f"--dry-run reads only metadata, and a verl-fsdp2 checkpoint"),
        (("--src", checkpoints["tied"].path, "--dst", str(tmp_path / "out"), "--rates", "write=none"), "--rates"),
    ]
    for arguments, fragment in cases:
        completed = run_main(*arguments, "--dry-run")
        errors = error_lines(completed)
        assert completed.returncode == 1 and len(errors) == 1 and fragment in errors[0], completed.stderr[-2000:]
        assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_a_235b_moe_megatron_save_is_planned_from_its_metadata(tmp_path):
    """Qwen3-235B-A22B saved by Megatron-Core at PP4 x EP8 (24 725 chunks, 470 GB of holes):
    every tensor of the on-disk format is planned, 94 layers of 128 experts, with exactly the
    model's bytes shared over the workers, read and written once."""
    model_bytes = write_sparse_checkpoint(str(tmp_path / "actor"))
    dry = _planned(tmp_path, "--src", str(tmp_path / "actor"), "--dst", str(tmp_path / "export"), "--workers", "8")
    cost = dry["cost"]
    layers, experts = QWEN3_235B_A22B["num_hidden_layers"], QWEN3_235B_A22B["num_experts"]
    assert dry["layout"] == "megatron" and dry["format"] == "on-disk"
    assert cost["tensor_count"] == layers * (3 * experts + 9) + 3  # experts' 3 each, attention 6, norms 2, router
    assert cost["tensor_bytes"] == model_bytes == sum(worker["bytes_read"] for worker in cost["workers"])
    assert sum(worker["bytes_written"] for worker in cost["workers"]) > model_bytes  # and the headers
    assert len(cost["workers"]) == 8 and all(worker["files"] for worker in cost["workers"])
    assert not os.path.exists(tmp_path / "export")


@pytest.mark.slow
def test_a_70b_fsdp_dcp_save_is_planned_from_its_metadata_through_the_python_api(tmp_path):
    """Llama 3.3 70B saved through DCP by 64 FSDP2 ranks (46 272 chunks of holes), planned by
    `rayexport.dry_run`: its bytes, every tensor, and the embedding and head, larger than a
    bucket, named as over the bound."""
    from rayexport import dry_run

    model_bytes = write_sparse_fsdp_dcp(str(tmp_path / "ckpt"))
    planned = dry_run(str(tmp_path / "ckpt"), str(tmp_path / "export"), workers=16)
    cost = planned.cost
    assert planned.layout == "dcp" and planned.world_size == 64 and planned.workers == 16
    assert cost.tensor_count == 80 * 9 + 3
    assert cost.tensor_bytes == model_bytes == sum(worker.bytes_read for worker in cost.workers)
    over = cost.over_bound()
    assert over and f"worker(s) {', '.join(map(str, over))}: a tensor larger than --bucket-size" in planned.summary()
    assert not os.path.exists(tmp_path / "export")
