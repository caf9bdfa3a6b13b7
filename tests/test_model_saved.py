"""rayexport.model.saved: a model described by one process is described to the next from the file
it saved, until a byte of its folder or of this package changes; a file that cannot be read
is derived afresh, and an empty RAYEXPORT_CACHE saves nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import rayexport.model.description as description
import rayexport.model.saved as saved
from rayexport.model.description import build_meta_model
from rayexport.storage.store import Store
from support.models import tiny_config, write_hf_folder


@pytest.fixture
def builds(tmp_path, monkeypatch):
    """Each meta model built, in a process that has described nothing yet, saving under tmp_path."""
    monkeypatch.setenv("RAYEXPORT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(description, "_DESCRIBED", {})
    built = []
    monkeypatch.setattr(description, "build_meta_model", lambda *args: built.append(args) or build_meta_model(*args))
    return built


def described_anew(folder, monkeypatch):
    """describe_model as a new process runs it: nothing described in memory."""
    monkeypatch.setattr(description, "_DESCRIBED", {})
    return description.describe_model(Store(str(folder)), None, False)


def test_a_later_process_reads_the_description_saved_until_a_byte_of_the_folder_changes(tmp_path, monkeypatch, builds):
    folder = tmp_path / "hf"
    write_hf_folder(tiny_config("qwen2-tied"), str(folder))
    first = described_anew(folder, monkeypatch)
    again = described_anew(folder, monkeypatch)
    assert len(builds) == 1 and again == first and again is not first
    assert again.formats.tie_aliases() == first.formats.tie_aliases() == {"lm_head.weight": "model.embed_tokens.weight"}
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 17}))
    changed = described_anew(folder, monkeypatch)
    assert len(builds) == 2 and changed.carried["tokenizer_config.json"] == b'{"model_max_length": 17}'


def test_a_description_saved_by_other_source_or_other_transformers_is_derived_afresh(tmp_path, monkeypatch, builds):
    folder = tmp_path / "hf"
    write_hf_folder(tiny_config(), str(folder))
    described_anew(folder, monkeypatch)
    monkeypatch.setattr(saved, "source_digest", lambda: "another version of rayexport")
    described_anew(folder, monkeypatch)
    monkeypatch.setattr(description, "_folder_key", lambda local, trust: "built by another transformers")
    described_anew(folder, monkeypatch)
    assert len(builds) == 3


@pytest.mark.parametrize("damage", ["truncated", "not a pickle", "unreadable"])
def test_a_saved_file_that_cannot_be_read_is_derived_afresh_and_saved_again(tmp_path, monkeypatch, builds, damage):
    folder = tmp_path / "hf"
    write_hf_folder(tiny_config(), str(folder))
    first = described_anew(folder, monkeypatch)
    (path,) = (tmp_path / "cache" / "descriptions").iterdir()
    data = path.read_bytes()
    if damage == "unreadable":
        path.unlink()
        path.mkdir()  # opening it fails
    else:
        path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"{}")
    assert described_anew(folder, monkeypatch) == first and len(builds) == 2
    if damage != "unreadable":
        assert described_anew(folder, monkeypatch) == first and len(builds) == 2


def test_an_empty_rayexport_cache_saves_nothing(tmp_path, monkeypatch, builds):
    monkeypatch.setenv("RAYEXPORT_CACHE", "")
    folder = tmp_path / "hf"
    write_hf_folder(tiny_config(), str(folder))
    described_anew(folder, monkeypatch)
    described_anew(folder, monkeypatch)
    assert len(builds) == 2 and not (tmp_path / "cache").exists()


def test_the_cache_folder_defaults_to_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("RAYEXPORT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert saved.cache_folder() == str(tmp_path / "xdg" / "rayexport")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert saved.cache_folder() == str(tmp_path / "home" / ".cache" / "rayexport")


def test_the_newest_descriptions_are_kept_and_the_folder_is_private(tmp_path):
    folder = tmp_path / "descriptions"
    kept = saved.SavedDescriptions(str(folder), limit=2)
    for index, key in enumerate(("a", "b", "c")):
        kept[key] = f"description {key}"
        os.utime(kept._path(key), (index, index))  # distinct ages, whatever the clock's resolution
    assert [os.path.exists(kept._path(key)) for key in "abc"] == [False, True, True]
    assert kept.get("b") == "description b"  # read after "c" was written: "c" is now the oldest
    kept["d"] = "description d"
    assert [os.path.exists(kept._path(key)) for key in "bcd"] == [True, False, True]
    assert folder.stat().st_mode & 0o777 == 0o700
    assert not [name for name in os.listdir(folder) if not name.endswith(".pickle")]


def test_a_later_export_of_the_model_describes_it_without_importing_transformers(tmp_path):
    """What the saving is for: the second process's description costs no transformers import
    (the command line's driver then imports torch alone while its workers start)."""
    folder = tmp_path / "hf"
    write_hf_folder(tiny_config(), str(folder))
    describe = (
        "import sys; from rayexport.model.description import describe_model; from rayexport.storage.store import Store; "
        f"model = describe_model(Store({str(folder)!r}), None, False); "
        "print(sorted(model.formats.disk.expected)[0], 'transformers' in sys.modules)"
    )
    environment = dict(os.environ, RAYEXPORT_CACHE=str(tmp_path / "cache"))
    first, second = (
        subprocess.run([sys.executable, "-c", describe], env=environment, capture_output=True, text=True, check=True).stdout.split()
        for _ in range(2)
    )
    assert first == ["lm_head.weight", "True"] and second == ["lm_head.weight", "False"]
