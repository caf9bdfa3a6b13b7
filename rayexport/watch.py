"""Scheduled exports: every checkpoint under a prefix that has no committed export yet.

State lives in the destinations (their manifests and claim objects), so a restarted watcher
resumes where it was and two watchers never export the same checkpoint at once.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rayexport.errors import ExportError
from rayexport.layouts.dcp import DCP_METADATA
from rayexport.layouts.verl import FSDP_CONFIG
from rayexport.manifest import read_manifest
from rayexport.storage import Store

log = logging.getLogger(__name__)

STEP = re.compile(r"(?:global_step|step)[_-]?(\d+)")
CLAIM_NAME = ".rayexport-claim"
# A claim older than this is a watcher that died mid-export; another may take the checkpoint over.
CLAIM_STALE_S = 6 * 3600


@dataclass(frozen=True)
class Candidate:
    """A checkpoint found under the watched prefix."""

    source: str
    relative: str
    step: int | None

    @property
    def order(self) -> tuple:
        return (self.step is None, self.step or 0, self.relative)


def find_candidates(root: Store, pattern: str) -> list[Candidate]:
    """Checkpoint prefixes under `root` matching the glob `pattern`, oldest step first."""
    base = root.path()
    try:
        matches = root.fs.glob(posixpath.join(base, pattern))
    except Exception as error:  # noqa: BLE001 - storage clients raise many types
        raise ExportError(f"cannot list '{root.uri}/{pattern}': {error}") from None
    candidates = []
    for match in matches:
        relative = posixpath.relpath(match, base)
        found = STEP.findall(relative)
        candidates.append(Candidate(root.child(relative).uri, relative, int(found[-1]) if found else None))
    return sorted(candidates, key=lambda candidate: candidate.order)


def destination_for(template: str, candidate: Candidate) -> str:
    """`--dst-template` filled in: `{step}` and `{name}` (the matched path, '/' as '_')."""
    return template.format(step=candidate.step, name=candidate.relative.replace("/", "_"))


def snapshot(store: Store) -> dict[str, int] | None:
    """Names and sizes of a checkpoint's files, or None while it is incomplete (no
    fsdp_config.json / .metadata yet: the trainer writes those last)."""
    names = store.list()
    if FSDP_CONFIG not in names and DCP_METADATA not in names:
        return None
    return {name: store.size(name) for name in names}


def claim(destination: Store, owner: str) -> bool:
    """Take the checkpoint for `owner` by creating the claim object exclusively; a stale claim
    (a dead watcher's) is replaced. False when another watcher holds it."""
    record = json.dumps({"owner": owner, "time": time.time()}).encode()
    try:
        with destination.fs.open(destination.path(CLAIM_NAME), "xb") as handle:
            handle.write(record)
        return True
    except FileExistsError:
        pass
    except Exception as error:  # noqa: BLE001 - some stores have no exclusive create
        if destination.exists(CLAIM_NAME):
            log.debug("exclusive create unavailable (%s); reading the claim", error)
        else:
            destination.write_bytes(CLAIM_NAME, record)
            return True
    held = json.loads(destination.read_bytes(CLAIM_NAME) or b"{}")
    if held.get("owner") == owner or time.time() - held.get("time", 0) > CLAIM_STALE_S:
        destination.write_bytes(CLAIM_NAME, record)
        return True
    return False


def watch_once(
    root: str,
    pattern: str,
    dst_template: str,
    options: dict[str, Any],
    storage_options: dict[str, Any],
    settle_s: float = 5.0,
) -> list[dict[str, Any]]:
    """One pass: export, oldest first, each complete checkpoint with no committed export.

    A checkpoint is complete when its last-written file exists and its files do not change
    over `settle_s` seconds. Returns what happened to each candidate.
    """
    from rayexport.job import export
    owner = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    results = []
    for candidate in find_candidates(Store(root, storage_options), pattern):
        source = Store(candidate.source, storage_options)
        destination_uri = destination_for(dst_template, candidate)
        destination = Store(destination_uri, storage_options)
        outcome = {"source": candidate.source, "destination": destination_uri, "step": candidate.step}
        if read_manifest(destination) is not None:
            results.append(dict(outcome, status="already exported"))
            continue
        before = snapshot(source)
        if before is None:
            results.append(dict(outcome, status="incomplete"))
            continue
        time.sleep(settle_s)
        if snapshot(source) != before:
            results.append(dict(outcome, status="still being written"))
            continue
        if not claim(destination, owner):
            results.append(dict(outcome, status="claimed by another watcher"))
            continue
        try:
            report = export(candidate.source, destination_uri, storage_options=storage_options, **options)
            results.append(dict(outcome, status="exported", manifest=report.manifest))
        except ExportError as error:
            log.error("export of %s failed: %s", candidate.source, error)
            results.append(dict(outcome, status="failed", error=str(error)))
        finally:
            destination.delete(CLAIM_NAME)
    return results


def watch(root: str, pattern: str, dst_template: str, options: dict[str, Any], storage_options: dict[str, Any],
          interval_s: float, settle_s: float = 5.0) -> None:
    """Poll forever: a pass every `interval_s` seconds."""
    while True:
        for result in watch_once(root, pattern, dst_template, options, storage_options, settle_s):
            log.info("%s: %s", result["source"], result["status"])
        time.sleep(interval_s)
