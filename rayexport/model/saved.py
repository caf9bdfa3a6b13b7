"""Model descriptions kept between exports: an export of a later checkpoint of a model describes
it from what an earlier one derived, without building the meta model and tracing its conversion
again, or importing transformers' model code, the most of those seconds. A process keeps its
recent ones (a watcher's exports, `export_remote`'s in a reused Ray worker), a pool's keeper
those of its exports (`rayexport.orchestration.pool`), and files keep them for later processes:
each command line export of a later checkpoint (`ray job submit` after each save, a cron'd
`--watch --once`), whose driver then leaves the CPUs to its starting workers.

The files are saved under RAYEXPORT_CACHE (default `$XDG_CACHE_HOME/rayexport`, else
`~/.cache/rayexport`), in `descriptions/`, a file per description; RAYEXPORT_CACHE set empty saves
and reads none. A file's name covers what its description is derived from (every byte of the
model's folder, whether remote code runs, the transformers that built it) and this package's own
source, so that a change to any of them derives it afresh. The newest SAVED_LIMIT are kept.

The files are pickles, which run code as they load: the folder is made private to its user, as
the Hub's cache of remote code is theirs."""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import tempfile
from typing import Any, Protocol

CACHE_VARIABLE = "RAYEXPORT_CACHE"
SAVED_LIMIT = 16


def cache_folder() -> str | None:
    """The folder RAYEXPORT_CACHE names (None where it is set empty), by default the user's
    cache folder's `rayexport`."""
    named = os.environ.get(CACHE_VARIABLE)
    if named is not None:
        return named or None
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rayexport")


@functools.cache
def source_digest() -> str:
    """A digest of this package's Python source: descriptions saved by other code are not read."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, folders, names in sorted(os.walk(package)):
        folders.sort()
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, "rb") as handle:
                    digest.update(os.path.relpath(path, package).encode() + b"\0" + handle.read())
    return digest.hexdigest()


class Described(Protocol):
    """Descriptions derived before (`description.ModelDescription`), by what each is derived
    from (`description._folder_key`)."""

    def get(self, key: str) -> Any: ...

    def __setitem__(self, key: str, description: Any) -> None: ...


class RecentDescriptions(dict):
    """The last `limit` descriptions kept, the oldest dropped first."""

    def __init__(self, limit: int = 8) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: str, description: Any) -> None:
        if key not in self and len(self) >= self.limit:
            self.pop(next(iter(self)))
        super().__setitem__(key, description)


class SavedDescriptions:
    """Descriptions in files under `folder`, by key (the newest `limit` kept). A file that
    cannot be read is a description not saved."""

    def __init__(self, folder: str, limit: int = SAVED_LIMIT) -> None:
        self.folder = folder
        self.limit = limit

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, hashlib.sha256(f"{key}\0{source_digest()}".encode()).hexdigest() + ".pickle")

    def get(self, key: str) -> Any:
        path = self._path(key)
        try:
            with open(path, "rb") as handle:
                description = pickle.load(handle)
            os.utime(path)  # the newest used is the last dropped
        except Exception:  # noqa: BLE001 - missing, partly written by a killed run, or from other code
            return None
        return description

    def __setitem__(self, key: str, description: Any) -> None:
        try:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.folder, suffix=".partial", delete=False) as handle:
                pickle.dump(description, handle, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(handle.name, self._path(key))  # whole or not at all, for a reader at the same time
            self._drop_oldest()
        except OSError:
            return  # a cache that cannot be written costs the next export its description, nothing more

    def _drop_oldest(self) -> None:
        saved = [entry for entry in os.scandir(self.folder) if entry.name.endswith(".pickle")]
        saved.sort(key=lambda entry: entry.stat().st_mtime, reverse=True)
        for entry in saved[self.limit:]:
            os.unlink(entry.path)


class Layered:
    """Descriptions looked up in `layers` in order; one found
    in a later layer is kept in the earlier ones, and one derived is kept in all."""

    def __init__(self, *layers: Described) -> None:
        self.layers = layers

    def get(self, key: str) -> Any:
        for index, layer in enumerate(self.layers):
            found = layer.get(key)
            if found is not None:
                for earlier in self.layers[:index]:
                    earlier[key] = found
                return found
        return None

    def __setitem__(self, key: str, description: Any) -> None:
        for layer in self.layers:
            layer[key] = description


def with_saved(described: Described) -> Described:
    """`described`, then the descriptions saved under RAYEXPORT_CACHE (unless it is set empty)."""
    folder = cache_folder()
    if folder is None:
        return described
    return Layered(described, SavedDescriptions(os.path.join(folder, "descriptions")))
