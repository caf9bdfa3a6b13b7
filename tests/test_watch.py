"""Scheduled exports: state lives in the destinations, so passes and restarts export each
checkpoint once, oldest first, skipping ones still being written."""

from __future__ import annotations

import os
import shutil
import threading
import time

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from rayexport.common.errors import ExportError
from rayexport.storage.settings import storage_options_from_env
from rayexport.storage.store import Store
from rayexport.watch import (
    CLAIM_NAME, CLAIM_STALE_S, Candidate, claim, destination_for, exclusive_create_honoured, find_candidates, watch_once,
)
from support.helpers import run_cli, run_main, s3_exists, upload


class OverwritingFileSystem(LocalFileSystem):
    """Stands for an S3-compatible store that ignores `If-None-Match`: an exclusive create
    ("xb") silently overwrites an existing object, as a plain write does. Objects need no
    folders, as on S3."""

    protocol = "overwriting"

    def __init__(self, **kwargs):
        super().__init__(auto_mkdir=True, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("overwriting://"))

    def _open(self, path, mode="rb", **kwargs):
        return super()._open(path, mode.replace("x", "w"), **kwargs)


fsspec.register_implementation("overwriting", OverwritingFileSystem, clobber=True)


@pytest.fixture(params=["s3", "local", "overwriting"])
def destination(request, tmp_path):
    """An export's destination on moto's S3 (honours exclusive create), the local filesystem
    (honours it) and a store that ignores it."""
    if request.param == "s3":
        return Store(request.getfixturevalue("s3_prefix") + "/exports/step7", storage_options_from_env())
    return Store(f"{'overwriting://' if request.param == 'overwriting' else ''}{tmp_path}/exports/step7")


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
    assert not [name for name in Store(f"{s3_prefix}/exports/step100").list() if name.startswith(".rayexport")]

    upload(str(checkpoints["tied"].path) + "/fsdp_config.json", f"{root}/global_step_300/actor/fsdp_config.json")
    second = watch_once(root, "global_step_*/actor", template, options, storage, settle_s=0.2)
    assert statuses(second) == [(100, "already exported"), (200, "already exported"), (300, "exported")]

    restarted = run_main("--watch", root, "--dst-template", template, "--once", "--settle", "0.2", "--verify", "none")
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    assert restarted.stdout.count("already exported") == 3 and "exported:" not in restarted.stdout.replace("already exported:", "")

def test_exclusive_create_is_probed_and_the_probe_removed(destination):
    assert exclusive_create_honoured(destination) is (not destination.uri.startswith("overwriting://"))
    assert destination.list() == []


def test_two_watchers_never_hold_one_checkpoint(destination):
    """Eight watchers claim one checkpoint at the same moment, each as `watch_once` does: exactly
    one holds it; once it lets go, the next watcher may take it."""
    start = threading.Barrier(8)
    held = {}

    def watcher(owner: str) -> None:
        exclusive = exclusive_create_honoured(destination)
        start.wait()
        held[owner] = claim(destination, owner, exclusive)

    threads = [threading.Thread(target=watcher, args=(f"watcher-{index}",)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    holders = {owner: name for owner, name in held.items() if name is not None}
    assert len(holders) == 1, holders
    (owner, name), = holders.items()
    assert not claim(destination, "late-watcher", exclusive_create_honoured(destination))
    destination.delete(name)
    assert claim(destination, "late-watcher", exclusive_create_honoured(destination))


def test_a_dead_watchers_claim_is_taken_over(destination):
    exclusive = exclusive_create_honoured(destination)
    claim(destination, "dead-watcher", exclusive)
    assert not claim(destination, "watcher-b", exclusive)
    if exclusive:
        destination.write_json(CLAIM_NAME, {"owner": "dead-watcher", "time": time.time() - CLAIM_STALE_S - 1})
    else:
        old = [name for name in destination.list() if name.startswith(CLAIM_NAME)]
        destination.delete(old[0])
        destination.write_bytes(f"{CLAIM_NAME}.{int(time.time() - CLAIM_STALE_S - 1)}.dead-watcher", b"")
    name = claim(destination, "watcher-b", exclusive)
    assert name and [entry for entry in destination.list() if entry.startswith(CLAIM_NAME)] == [name]

def test_candidates_sorted_by_step_and_destinations(tmp_path):
    for name in ("global_step_20/actor", "global_step_3/actor", "other/actor"):
        os.makedirs(tmp_path / name)
    found = find_candidates(Store(str(tmp_path)), "global_step_*/actor")
    assert [candidate.step for candidate in found] == [3, 20]
    assert destination_for("s3://b/exports/{step}", found[0]) == "s3://b/exports/3"
    assert destination_for("s3://b/{name}", Candidate("x", "global_step_3/actor", 3)) == "s3://b/global_step_3_actor"

def test_a_listing_failure_is_one_line(s3_endpoint, tmp_path):
    with pytest.raises(ExportError) as error:
        watch_once("s3://no such bucket/run7", "global_step_*/actor", str(tmp_path / "{step}"), {}, storage_options_from_env())
    assert "Parameter validation failed: Invalid bucket name" in str(error.value)  # botocore's two lines, as one


def test_watch_needs_a_template():
    completed = run_cli("--watch", "/tmp/x")
    assert completed.returncode == 2 and "--dst-template" in completed.stderr
