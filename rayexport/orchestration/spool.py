"""Where workers spool remote rank files on their node's disk, and which spool folders a later
export may remove. Plain file operations, no Ray.

On each node: `<tmp>/rayexport-spool-<uid>/<export-id>/worker<N>.<pidns>.<pid>.<start>`. The
export id carries when the export's deadline has surely passed; each worker folder names the
process that owns it (its pid, when that process started, and its pid namespace, so that a pid
seen from another container is never judged). A worker folder is stale once that process is
gone, or once its export's deadline has passed; a live worker's folder is never stale, whichever
export sweeps. The driver removes a failed export's folders itself (`remove_export`); the sweep
(`sweep`, at each worker's start) catches what a killed driver could not.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import stat
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from rayexport.common.errors import ExportError

# Slack past the export's --deadline before its folders count as stale whoever owns them:
# clocks of different nodes, and the time a failing export takes to remove its workers.
GRACE_S = 600.0


@dataclass(frozen=True)
class Owner:
    """The process a worker folder belongs to."""

    namespace: str
    pid: int
    start: str


def spool_root(tmp: str | None = None) -> str:
    """This user's spool folder under the temp folder (`tmp`, default the system's)."""
    return os.path.join(tmp or tempfile.gettempdir(), f"rayexport-spool-{os.getuid()}")


def new_export_id(seconds_left: float, now: float | None = None) -> str:
    """A fresh export id for an export with `seconds_left` until its deadline."""
    expires = (time.time() if now is None else now) + seconds_left + GRACE_S
    return f"until{int(expires)}-{uuid.uuid4().hex[:12]}"


def export_expiry(export_id: str) -> float | None:
    """When an export id's folders count as stale whoever owns them; None if not an export id."""
    head, _, token = export_id.partition("-")
    if not head.startswith("until") or not head[5:].isdigit() or not token:
        return None
    return float(head[5:])


def process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, Linux); None if it is not running.
    Where /proc is missing, "-" for any running process."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except FileNotFoundError:
        return None
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "-"


def pid_namespace() -> str:
    """This process's pid namespace (Linux), or a tag of its host name elsewhere."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "h" + hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12]


def this_process() -> Owner:
    """The calling process as the owner of a worker folder."""
    pid = os.getpid()
    return Owner(pid_namespace(), pid, process_start(pid) or "-")


def worker_folder_name(index: int, owner: Owner) -> str:
    """The name of worker `index`'s folder, owned by `owner`."""
    return f"worker{index}.{owner.namespace}.{owner.pid}.{owner.start}"


def folder_owner(name: str) -> Owner | None:
    """The owner a worker folder's name records; None if it is not a worker folder's name."""
    parts = name.split(".")
    if len(parts) != 4 or not parts[0].startswith("worker") or not parts[2].isdigit():
        return None
    return Owner(parts[1], int(parts[2]), parts[3])


def is_stale(
    export_id: str, folder: str, now: float, namespace: str, start_of: Callable[[int], str | None]
) -> bool:
    """Whether worker folder `folder` of export `export_id` may be removed: its export is past
    its deadline, or its owner is a process of `namespace` that is gone (`start_of(pid)`: when
    that pid's process started, None if none runs). Names not made here are never stale."""
    expiry = export_expiry(export_id)
    owner = folder_owner(folder)
    if expiry is None or owner is None:
        return False
    if now > expiry:
        return True
    return owner.namespace == namespace and start_of(owner.pid) != owner.start


def ensure_root(root: str) -> str:
    """Create the spool folder (mode 700) if needed; refuse one that is not this user's own
    folder, since whoever owns it could change the files spooled there."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ExportError(f"the spool folder '{root}' is not a folder of this user: remove it, or set TMPDIR elsewhere")
    return root


def sweep(root: str, now: float | None = None) -> list[str]:
    """Remove the stale worker folders under `root` (see `is_stale`), and export folders left
    empty or past their deadline; return what was removed."""
    now = time.time() if now is None else now
    namespace = pid_namespace()
    removed = []
    for export_id in _listdir(root):
        export_dir = os.path.join(root, export_id)
        expiry = export_expiry(export_id)
        if expiry is None or not os.path.isdir(export_dir):
            continue
        if now > expiry:
            shutil.rmtree(export_dir, ignore_errors=True)
            removed.append(export_dir)
            continue
        for folder in _listdir(export_dir):
            if is_stale(export_id, folder, now, namespace, process_start):
                shutil.rmtree(os.path.join(export_dir, folder), ignore_errors=True)
                removed.append(os.path.join(export_dir, folder))
        if _remove_if_empty(export_dir):
            removed.append(export_dir)
    return removed


def make_worker_folder(root: str, export_id: str, index: int) -> str:
    """Create worker `index`'s folder for `export_id`, owned by the calling process."""
    path = os.path.join(ensure_root(root), export_id, worker_folder_name(index, this_process()))
    for attempt in range(3):
        try:
            os.makedirs(path)
            break
        except FileNotFoundError:  # another export's sweep removed the export folder, still empty
            if attempt == 2:
                raise
    return path


def remove_worker_folder(path: str) -> None:
    """Remove a worker's folder, and its export's folder once no worker's is left there."""
    shutil.rmtree(path, ignore_errors=True)
    _remove_if_empty(os.path.dirname(path))


def remove_export(export_id: str, root: str | None = None) -> int:
    """Remove export `export_id`'s folder on this node (every worker's); return the bytes freed.
    A worker just killed may still be creating a file there, so a folder that is not gone at
    once is tried again."""
    export_dir = os.path.join(root or spool_root(), export_id)
    freed = _size(export_dir)
    for _ in range(5):
        shutil.rmtree(export_dir, ignore_errors=True)
        if not os.path.exists(export_dir):
            break
        time.sleep(0.5)
    return freed


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _remove_if_empty(path: str) -> bool:
    try:
        os.rmdir(path)
        return True
    except OSError:
        return False


def _size(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total
