"""The CLI as a user runs it: real FSDP2 checkpoints on the S3 server, exported by Ray actors
over gloo back to S3, reloaded with transformers (the primary case in a fresh process)."""

from __future__ import annotations

import json
import logging
import math
import os
import re

import pytest
import torch
from safetensors import safe_open

from support.helpers import download, error_lines, reload, reload_in_fresh_process, run_cli, run_main

pytestmark = pytest.mark.usefixtures("ray_address")


def export_and_reload(src: str, dst: str, tmp_path, *extra: str, fresh_process: bool = False) -> tuple[dict, str, dict]:
    completed = run_cli("--src", src, "--dst", dst, "--workers", "2", "--report", "-", "--dtype", "float32", *extra)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout[completed.stdout.index("{"):])
    local = download(dst, str(tmp_path / "export"))
    return report, local, (reload_in_fresh_process if fresh_process else reload)(local)


def weight_keys(local: str) -> set[str]:
    keys = set()
    for name in ("model.safetensors",):
        with safe_open(f"{local}/{name}", framework="pt") as handle:
            keys |= set(handle.keys())
    return keys


def test_tied_model_s3_to_s3_matches_original(checkpoints, s3_checkpoints, s3_prefix, tmp_path):
    report, local, reloaded = export_and_reload(s3_checkpoints["tied"], s3_prefix, tmp_path, fresh_process=True)
    assert report["world_size"] == 3 and report["workers"] == 2 and report["backend"] == "gloo"
    assert report["verification"]["passed"] is True
    assert report["reload_process"]["imports_s"] > 0  # worker 0 started it with the group
    torch.testing.assert_close(reloaded["logits"], checkpoints["tied"].logits, rtol=1e-5, atol=1e-6)
    assert reloaded["shared"] is True
    keys = weight_keys(local)
    assert "model.embed_tokens.weight" in keys
    assert "lm_head.weight" not in keys
    manifest = json.load(open(f"{local}/export_manifest.json"))
    assert manifest["source"] == s3_checkpoints["tied"]
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"}
    assert manifest["tensor_count"] == len(keys)


def test_untied_model_keeps_its_head(checkpoints, s3_checkpoints, s3_prefix, tmp_path):
    _, local, reloaded = export_and_reload(s3_checkpoints["untied"], s3_prefix, tmp_path)
    torch.testing.assert_close(reloaded["logits"], checkpoints["untied"].logits, rtol=1e-5, atol=1e-6)
    assert reloaded["shared"] is False
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= weight_keys(local)


def test_hsdp_mesh_reads_one_replica(checkpoints, s3_checkpoints, s3_prefix, tmp_path):
    report, _, reloaded = export_and_reload(s3_checkpoints["hsdp"], s3_prefix, tmp_path, "--verify", "none")
    assert report["reload_process"] == {}  # nothing verifies: no reload process was started
    torch.testing.assert_close(reloaded["logits"], checkpoints["hsdp"].logits, rtol=1e-5, atol=1e-6)
    # ranks 2 and 3 hold the second "ddp" replica, identical to ranks 0 and 1: never read
    first_replica = sum(os.path.getsize(f"{checkpoints['hsdp'].path}/model_world_size_4_rank_{rank}.pt") for rank in (0, 1))
    assert report["world_size"] == 4 and report["bytes"]["read"] == first_replica


def test_bfloat16_output_and_several_shard_files(checkpoints, s3_checkpoints, s3_prefix, tmp_path):
    report, local, reloaded = export_and_reload(
        s3_checkpoints["tied"], s3_prefix, tmp_path, "--verify", "none", "--dtype", "bfloat16", "--max-shard-size", "100KB",
        "--bucket-size", "20KB",
    )
    shards = sorted(name for name in report["files"] if name.endswith(".safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.load(open(f"{local}/model.safetensors.index.json"))
    assert "lm_head.weight" not in index["weight_map"]
    assert json.load(open(f"{local}/config.json"))["dtype"] == "bfloat16"
    assert reloaded["dtype"] == "torch.bfloat16" and reloaded["shared"] is True
    torch.testing.assert_close(
        reloaded["logits"].float(), checkpoints["tied"].logits, rtol=0.05, atol=0.02
    )


def test_local_paths_work_too(checkpoints, tmp_path):
    destination = tmp_path / "out"
    completed = run_main("--src", checkpoints["untied"].path, "--dst", str(destination), "--workers", "3", "--verify", "quick", "--dtype", "float32")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "committed:" in completed.stdout
    torch.testing.assert_close(
        reload(str(destination))["logits"], checkpoints["untied"].logits, rtol=1e-5, atol=1e-6
    )


def test_rerun_of_a_committed_export_does_nothing(checkpoints, tmp_path):
    destination = str(tmp_path / "out")
    assert run_main("--src", checkpoints["tied"].path, "--dst", destination, "--verify", "none").returncode == 0
    again = run_main("--src", checkpoints["tied"].path, "--dst", destination, "--verify", "none")
    assert again.returncode == 0 and "already holds a committed export" in again.stdout
    other = run_main("--src", checkpoints["untied"].path, "--dst", destination, "--verify", "none")
    assert other.returncode == 1 and "--force" in other.stderr


def test_tokenizer_that_does_not_load_fails_verification_and_commits_nothing(checkpoints, tmp_path):
    import shutil

    source = shutil.copytree(checkpoints["tied"].path, tmp_path / "source")
    config_path = source / "huggingface" / "tokenizer_config.json"
    config_path.write_text(json.dumps(dict(json.loads(config_path.read_text()), tokenizer_class="BogusTokenizer")))
    destination = tmp_path / "out"
    completed = run_main("--src", str(source), "--dst", str(destination), "--verify", "full")
    errors = error_lines(completed)
    assert completed.returncode == 1 and len(errors) == 1
    assert errors[0].startswith("rayexport: error: reload: tokenizer_config.json") and "'BogusTokenizer'" in errors[0]
    assert errors[0].endswith("; the export was not committed")  # the files at DST are no export
    assert not (destination / "export_manifest.json").exists()


def test_a_good_tokenizer_and_bfloat16_reload_pass_verification(checkpoints, tmp_path, caplog):
    """A float32 checkpoint written in bfloat16, with `--sha256`: the reload passes, every phase is
    timed, the report counts each pass over the bytes, and the manifest holds each file's
    SHA-256 beside its fast digest."""
    import hashlib

    caplog.set_level(logging.INFO, logger="rayexport")
    destination = tmp_path / "out"
    completed = run_main("--src", checkpoints["tied"].path, "--dst", str(destination), "--verify", "full",
                         "--dtype", "bfloat16", "--sha256", "--report", "-")
    assert completed.returncode == 0, completed.stderr[-3000:]
    for stage in ("load", "transfer", "verify_files"):  # one line per stage: bytes, seconds, rate
        assert re.search(rf"{stage}: \d+\.\d\d GB in \d+\.\d s \(\d+ MB/s\)", caplog.text), stage
    assert re.search(r"reload: \d+\.\d s", caplog.text)
    report = json.loads(completed.stdout[completed.stdout.index("{"):])
    reload_check = report["verification"]["checks"]["reload"]
    assert reload_check["tokenizer"] and reload_check["dtype"] == "bfloat16"
    # every step between the workers' start and the commit is a phase of its own (here Ray was joined)
    assert {"plan", "start_workers", "describe_model", "load", "plan_files", "transfer",
            "verify_files", "reload", "shutdown", "commit"} <= set(report["seconds"])
    assert "source_scan" not in report["seconds"]  # the transfer scans the source as it reads it
    manifest = json.loads((destination / "export_manifest.json").read_text())
    assert manifest["format"] == "rayexport/2" and manifest["digest"] == "xxh3_128"
    for name, record in manifest["files"].items():
        assert record["sha256"] == hashlib.sha256((destination / name).read_bytes()).hexdigest(), name
    # the passes: the source read once, by the transfer (scanned, cast to bfloat16 and hashed in
    # one loop as it is read), each written byte hashed twice more (tensor and file) plus SHA-256,
    # every file read back once
    written = sum(math.prod(tensor["shape"]) * 2 for tensor in manifest["tensors"].values())
    assert set(report["passes"]) == {"transfer", "verify_files"}
    transfer, check = (report["passes"][phase] for phase in ("transfer", "verify_files"))
    assert transfer["read"] == transfer["scanned"] == 2 * written
    assert transfer["written"] == written and transfer["hashed"] == 3 * written
    assert transfer["hashed_sha256"] == written and transfer["copied"] >= 2 * written  # the scan's cast and the writer's
    assert check["read"] == sum(record["size"] for record in manifest["files"].values())


def test_a_critic_exports_with_its_value_head(verl_checkpoints, tmp_path):
    """verl's FSDP critic (a token classifier of one label: a value per token) exports with its
    `score` head, weight and bias, and reloads computing the critic's values."""
    from transformers import AutoModelForTokenClassification

    from support.helpers import exported_tensors
    from support.models import PROMPT_IDS

    critic, destination = verl_checkpoints["critic"], str(tmp_path / "export")
    completed = run_main("--src", critic.path, "--dst", destination, "--verify", "full", "--dtype", "float32")
    assert completed.returncode == 0, completed.stderr[-3000:]
    tensors = exported_tensors(destination)
    assert {"score.weight", "score.bias"} <= set(tensors) and "lm_head.weight" not in tensors
    model = AutoModelForTokenClassification.from_pretrained(destination).eval()
    with torch.no_grad():
        values = model(input_ids=torch.tensor(PROMPT_IDS)).logits
    assert values.shape[-1] == 1
    torch.testing.assert_close(values, critic.logits, rtol=1e-5, atol=1e-6)
