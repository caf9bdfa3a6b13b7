"""Scheduled exports: state lives in the destinations, so passes and restarts export each
checkpoint once, oldest first, skipping ones still being written."""

from __future__ import annotations

import os
import shutil

from helpers import run_cli, run_main, s3_exists, upload
from rayexport.storage import Store, storage_options_from_env
from rayexport.watch import CLAIM_NAME, Candidate, claim, destination_for, find_candidates, watch_once

def statuses(results):
    return [(result["step"], result["status"]) for result in results]

def test_passes_export_each_complete_checkpoint_once(checkpoints, ray_address, s3_prefix, tmp_path):
    run = tmp_path / "run7"
    for step in (100, 300, 200):
        shutil.copytree(checkpoints["tied"].path, run / f"global_step_{step}" / "actor")
    os.remove(run / "global_step_300" / "actor" / "fsdp_config.json")  # the trainer writes it last
    root = upload(str(run), f"{s3_prefix}/run7")
    template = f"{s3_prefix}/exports/step{{step}}"
    options = {"workers": 2, "verify": "none"}
    storage = storage_options_from_env()

    first = watch_once(root, "global_step_*/actor", template, options, storage, settle_s=0.2)
    assert statuses(first) == [(100, "exported"), (200, "exported"), (300, "incomplete")]
    assert s3_exists(f"{s3_prefix}/exports/step100/export_manifest.json")
    assert not s3_exists(f"{s3_prefix}/exports/step100/{CLAIM_NAME}")

    upload(str(checkpoints["tied"].path) + "/fsdp_config.json", f"{root}/global_step_300/actor/fsdp_config.json")
    second = watch_once(root, "global_step_*/actor", template, options, storage, settle_s=0.2)
    assert statuses(second) == [(100, "already exported"), (200, "already exported"), (300, "exported")]

    restarted = run_main("--watch", root, "--dst-template", template, "--once", "--settle", "0.2", "--verify", "none")
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    assert restarted.stdout.count("already exported") == 3 and "exported:" not in restarted.stdout.replace("already exported:", "")

def test_a_fresh_claim_keeps_a_second_watcher_off(tmp_path):
    destination = Store(str(tmp_path / "dst"))
    os.makedirs(tmp_path / "dst")
    assert claim(destination, "watcher-a")
    assert not claim(destination, "watcher-b")
    assert claim(destination, "watcher-a")  # its own claim

def test_candidates_sorted_by_step_and_destinations(tmp_path):
    for name in ("global_step_20/actor", "global_step_3/actor", "other/actor"):
        os.makedirs(tmp_path / name)
    found = find_candidates(Store(str(tmp_path)), "global_step_*/actor")
    assert [candidate.step for candidate in found] == [3, 20]
    assert destination_for("s3://b/exports/{step}", found[0]) == "s3://b/exports/3"
    assert destination_for("s3://b/{name}", Candidate("x", "global_step_3/actor", 3)) == "s3://b/global_step_3_actor"

def test_watch_needs_a_template():
    completed = run_cli("--watch", "/tmp/x")
    assert completed.returncode == 2 and "--dst-template" in completed.stderr
