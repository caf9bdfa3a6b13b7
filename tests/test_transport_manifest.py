"""rayexport.transport.manifest: the commit object. What it records, that it reads back as written, and
that a destination without it holds no export, however many of the export's files it has."""

from __future__ import annotations

import datetime

import pytest

from rayexport.common.errors import ExportError
from rayexport.storage.store import Store
from rayexport.transport.manifest import MANIFEST_FORMAT, MANIFEST_NAME, build_manifest, commit, read_manifest

EXPECTED = {
    "files": {"model-00002-of-00002.safetensors": {"size": 20, "sha256": "b" * 64},
              "model-00001-of-00002.safetensors": {"size": 10, "sha256": "a" * 64}},
    "tensors": {"model.norm.weight": {"dtype": "float32", "shape": [32]},
                "model.embed_tokens.weight": {"dtype": "float32", "shape": [1000, 32]}},
    "tied": [["lm_head.weight", "model.embed_tokens.weight"]],
}


def _manifest(**changes) -> dict:
    fields = dict(source="s3://bucket/global_step_1/actor", layout="verl-fsdp2", world_size=3,
                  options={"dtype": "bfloat16"}, expected=EXPECTED, verification={"level": "quick", "passed": True})
    return build_manifest(**{**fields, **changes})


def test_the_manifest_records_the_export_and_its_verification():
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    manifest = _manifest()
    created = datetime.datetime.fromisoformat(manifest["created"])
    assert created.tzinfo is not None and before <= created <= datetime.datetime.now(datetime.timezone.utc)
    assert manifest["format"] == MANIFEST_FORMAT
    assert (manifest["source"], manifest["layout"], manifest["world_size"]) == ("s3://bucket/global_step_1/actor", "verl-fsdp2", 3)
    assert manifest["options"] == {"dtype": "bfloat16"}
    assert manifest["tensor_count"] == 2
    assert manifest["tied"] == EXPECTED["tied"]
    assert manifest["verification"] == {"level": "quick", "passed": True}
    # files and tensors in name order, so that two exports of one checkpoint compare line by line
    assert list(manifest["files"]) == sorted(EXPECTED["files"])
    assert list(manifest["tensors"]) == sorted(EXPECTED["tensors"])
    assert manifest["files"] == EXPECTED["files"] and manifest["tensors"] == EXPECTED["tensors"]


def test_a_committed_manifest_reads_back_as_written(tmp_path):
    store = Store(str(tmp_path / "export"))
    manifest = _manifest()
    commit(store, manifest)
    assert (tmp_path / "export" / MANIFEST_NAME).is_file()
    assert read_manifest(store) == manifest
    assert read_manifest(Store(str(tmp_path / "export") + "/")) == manifest  # the same prefix, however written


def test_a_second_commit_replaces_the_first(tmp_path):
    store = Store(str(tmp_path / "export"))
    commit(store, _manifest(world_size=3))
    commit(store, _manifest(world_size=4, options={"dtype": "float32"}))
    read = read_manifest(store)
    assert read["world_size"] == 4 and read["options"] == {"dtype": "float32"}


def test_a_half_written_destination_holds_no_export(tmp_path):
    """An export killed before its commit leaves its shards (and even an index) but no
    manifest: there is no committed export, and nothing is taken from the files."""
    destination = tmp_path / "export"
    destination.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json"):
        (destination / name).write_bytes(b"{}")
    assert read_manifest(Store(str(destination))) is None
    assert read_manifest(Store(str(tmp_path / "never-written"))) is None


def test_a_damaged_manifest_is_an_error_not_an_absent_export(tmp_path):
    store = Store(str(tmp_path / "export"))
    commit(store, _manifest())
    path = tmp_path / "export" / MANIFEST_NAME
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ExportError, match=f"'{store.display(MANIFEST_NAME)}' is not valid JSON"):
        read_manifest(store)
