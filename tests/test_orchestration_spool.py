"""rayexport.orchestration.spool: a worker's spool folder names its export and its process; a sweep removes
the folders of processes that are gone and of exports past their deadline, and never a live
worker's, nor anything it did not name."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rayexport.common.errors import ExportError
from rayexport.orchestration import spool

NOW = 1_800_000_000.0
LIVE = spool.Owner("4026531836", 4242, "1000")


def _dead_process() -> spool.Owner:
    """A process of this namespace that ran and is gone."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    owner = spool.Owner(spool.pid_namespace(), process.pid, spool.process_start(process.pid))
    process.kill()
    process.wait()
    return owner


def _folder(root, export_id: str, index: int, owner: spool.Owner, size: int = 1000) -> str:
    path = os.path.join(root, export_id, spool.worker_folder_name(index, owner))
    os.makedirs(path)
    with open(os.path.join(path, "model_world_size_2_rank_0.pt"), "wb") as handle:
        handle.write(b"\0" * size)
    return path


def test_an_export_id_carries_when_its_deadline_has_surely_passed():
    export_id = spool.new_export_id(3600, now=NOW)
    assert spool.export_expiry(export_id) == NOW + 3600 + spool.GRACE_S
    assert spool.new_export_id(3600, now=NOW) != export_id
    for foreign in ("rayexport-worker0-abc", "until-x", "untilsoon-abc", "until123"):
        assert spool.export_expiry(foreign) is None


def test_a_worker_folder_names_its_owner():
    name = spool.worker_folder_name(3, LIVE)
    assert name.startswith("worker3.")
    assert spool.folder_owner(name) == LIVE
    assert spool.folder_owner("notes.txt") is None and spool.folder_owner("worker1.a.b.c") is None


@pytest.mark.parametrize("start_now, namespace, now, stale", [
    ("1000", LIVE.namespace, NOW, False),  # its worker still runs
    (None, LIVE.namespace, NOW, True),  # its worker is gone
    ("2000", LIVE.namespace, NOW, True),  # the pid now belongs to another process
    (None, "another", NOW, False),  # a pid of another namespace (container) is not judged here
    ("1000", LIVE.namespace, NOW + 7200, True),  # past the export's deadline, whoever owns it
    (None, "another", NOW + 7200, True),
])
def test_which_worker_folder_is_stale(start_now, namespace, now, stale):
    export_id = spool.new_export_id(3600, now=NOW)
    folder = spool.worker_folder_name(0, LIVE)
    assert spool.is_stale(export_id, folder, now, namespace, lambda pid: start_now if pid == LIVE.pid else None) is stale


def test_names_not_made_here_are_never_stale():
    gone = lambda pid: None  # noqa: E731
    assert not spool.is_stale("my-notes", spool.worker_folder_name(0, LIVE), NOW * 2, LIVE.namespace, gone)
    assert not spool.is_stale(spool.new_export_id(0, now=0), "keep-me", NOW, LIVE.namespace, gone)


def test_the_running_process_reads_as_alive_and_a_finished_one_as_gone():
    me = spool.this_process()
    assert me.pid == os.getpid() and spool.process_start(me.pid) == me.start
    dead = _dead_process()
    assert dead.start is not None and spool.process_start(dead.pid) != dead.start


def test_a_sweep_removes_what_dead_workers_and_expired_exports_left_and_keeps_the_rest(tmp_path):
    root = spool.ensure_root(str(tmp_path / "spool"))
    live_export = spool.new_export_id(3600)
    live = _folder(root, live_export, 0, spool.this_process())
    dead_beside_live = _folder(root, live_export, 1, _dead_process())
    dead_export = spool.new_export_id(3600)
    dead = _folder(root, dead_export, 0, _dead_process())
    expired_export = spool.new_export_id(-2 * spool.GRACE_S)
    expired = _folder(root, expired_export, 0, spool.this_process())
    elsewhere = _folder(root, spool.new_export_id(3600), 0, spool.Owner("another", 1, "1"))
    foreign = tmp_path / "spool" / "not-an-export"
    foreign.mkdir()

    removed = spool.sweep(root)

    assert os.path.exists(live) and os.path.exists(elsewhere) and foreign.exists()
    for path in (dead_beside_live, dead, os.path.dirname(dead), os.path.dirname(expired)):
        assert not os.path.exists(path) and path in removed
    assert sorted(os.listdir(os.path.join(root, live_export))) == [os.path.basename(live)]


def test_workers_remove_their_folders_and_the_last_one_its_export(tmp_path):
    root = str(tmp_path / "spool")
    export_id = spool.new_export_id(3600)
    first, second = (spool.make_worker_folder(root, export_id, index) for index in (0, 1))
    assert os.path.dirname(first) == os.path.dirname(second) == os.path.join(root, export_id)
    spool.remove_worker_folder(first)
    assert os.path.isdir(os.path.join(root, export_id))
    spool.remove_worker_folder(second)
    assert os.listdir(root) == []


def test_a_failed_export_removes_its_own_folder_only(tmp_path):
    root = spool.ensure_root(str(tmp_path / "spool"))
    failed, other = spool.new_export_id(3600), spool.new_export_id(3600)
    _folder(root, failed, 0, spool.this_process(), size=3000)
    _folder(root, failed, 1, spool.Owner("another", 1, "1"), size=2000)
    kept = _folder(root, other, 0, spool.this_process())
    assert spool.remove_export(failed, root) == 5000
    assert sorted(os.listdir(root)) == [other] and os.path.exists(kept)


def test_a_spool_folder_not_this_users_own_is_refused(tmp_path):
    """Whoever owns the folder could change the rank files spooled there before they are read."""
    (tmp_path / "theirs").mkdir()
    os.symlink(tmp_path / "theirs", tmp_path / "spool")
    with pytest.raises(ExportError, match="is not a folder of this user"):
        spool.ensure_root(str(tmp_path / "spool"))
    assert spool.spool_root("/scratch") == f"/scratch/rayexport-spool-{os.getuid()}"
