"""Scheduled exports: every checkpoint under a prefix that has no committed export yet.

State lives in the destinations (their manifests and claim objects), so a restarted watcher
resumes where it was and two watchers never export the same checkpoint at once, also on stores
that ignore exclusive create (see `claim`).
"""

from __future__ import annotations

import json
import logging
import posixpath
import random
import re
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rayexport.common.errors import ExportError, one_line
from rayexport.layouts import registry
from rayexport.storage.store import Store
from rayexport.transport.manifest import read_manifest

log = logging.getLogger(__name__)

STEP = re.compile(r"(?:global_step|step)[_-]?(\d+)")
CLAIM_NAME = ".rayexport-claim"
# A claim older than this is a watcher that died mid-export; another may take the checkpoint over.
CLAIM_STALE_S = 6 * 3600
# Where exclusive create is not honoured, each watcher writes a claim object of its own, named
# with the time it was taken (so a listing alone tells a stale one): CLAIM_NAME.<unix time>.<owner>.
OWN_CLAIM = re.compile(re.escape(CLAIM_NAME) + r"\.(\d+)\..+")
CLAIM_ATTEMPTS = 3
CLAIM_BACKOFF_S = 1.0


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
        raise ExportError(f"cannot list '{root.uri}/{pattern}': {one_line(error)}") from None
    candidates = []
    for match in matches:
        relative = posixpath.relpath(match, base)
        found = STEP.findall(relative)
        candidates.append(Candidate(root.child(relative).uri, relative, int(found[-1]) if found else None))
    return sorted(candidates, key=lambda candidate: candidate.order)


def destination_for(template: str, candidate: Candidate) -> str:
    """`--dst-template` filled in: `{step}` and `{name}` (the matched path, '/' as '_')."""
    return template.format(step=candidate.step, name=candidate.relative.replace("/", "_"))


def exclusive_create_honoured(store: Store) -> bool:
    """Whether `store` refuses to create an object that already exists. S3 does (a conditional
    write, `If-None-Match`); some S3-compatible stores ignore the condition and overwrite. Probed
    by creating one object twice: the second create must fail."""
    probe = f".rayexport-probe-{uuid.uuid4().hex}"
    try:
        # Not empty: s3fs writes an empty object with a plain, unconditional PUT.
        store.create_exclusive(probe, b"probe")
        honoured = not store.create_exclusive(probe, b"probe")
    except Exception as error:  # noqa: BLE001 - a store without exclusive create may raise anything
        log.debug("exclusive create fails on '%s': %s", store.uri, one_line(error))
        honoured = False
    finally:
        store.delete(probe)
    if not honoured:
        log.info("'%s' does not honour exclusive create; watchers claim checkpoints by listing", store.uri)
    return honoured


def claim(destination: Store, owner: str, exclusive: bool) -> str | None:
    """Take the checkpoint exported to `destination` for the watcher `owner`: the name of its
    claim object (delete it when done), or None while another watcher holds it. A claim older
    than CLAIM_STALE_S (a dead watcher's) is taken over.

    With `exclusive` (`exclusive_create_honoured`), the claim is one object created exclusively.
    Without, each watcher writes a claim of its own and keeps it only if no other live one is
    listed afterwards: of two watchers claiming at once, the later to write sees the other's
    claim. One that sees another withdraws and, if the other withdrew too, tries again after a
    random pause (CLAIM_ATTEMPTS times in all)."""
    if not exclusive:
        return _claim_by_listing(destination, owner)
    record = json.dumps({"owner": owner, "time": time.time()}).encode()
    if destination.create_exclusive(CLAIM_NAME, record):
        return CLAIM_NAME
    # An empty claim is one being written, not a stale one.
    held = json.loads(destination.read_bytes(CLAIM_NAME) or b"{}")
    if held.get("owner") == owner or time.time() - held.get("time", time.time()) > CLAIM_STALE_S:
        destination.write_bytes(CLAIM_NAME, record)
        return CLAIM_NAME
    return None


def _claim_by_listing(destination: Store, owner: str) -> str | None:
    for attempt in range(CLAIM_ATTEMPTS):
        if attempt:
            time.sleep(random.uniform(0, CLAIM_BACKOFF_S))
        if _listed_claims(destination)[0]:
            return None
        mine = f"{CLAIM_NAME}.{int(time.time())}.{owner}"
        destination.write_bytes(mine, b"")
        live, stale = _listed_claims(destination)
        if live == [mine]:
            for name in stale:
                destination.delete(name)
            return mine
        destination.delete(mine)
    return None


def _listed_claims(destination: Store) -> tuple[list[str], list[str]]:
    """The watchers' own claim objects at `destination`: the live ones, and the stale ones."""
    live, stale = [], []
    for name in destination.list():
        taken = OWN_CLAIM.fullmatch(name)
        if taken:
            (stale if time.time() - int(taken.group(1)) > CLAIM_STALE_S else live).append(name)
    return live, stale


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
    from rayexport.orchestration.job import export
    owner = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    exclusive = None  # probed at the pass's first claim
    results = []
    for candidate in find_candidates(Store(root, storage_options), pattern):
        source = Store(candidate.source, storage_options)
        destination_uri = destination_for(dst_template, candidate)
        destination = Store(destination_uri, storage_options)
        outcome = {"source": candidate.source, "destination": destination_uri, "step": candidate.step}
        if read_manifest(destination) is not None:
            results.append(dict(outcome, status="already exported"))
            continue
        before = registry.snapshot(source)  # None: no completion marker yet
        if before is None:
            results.append(dict(outcome, status="incomplete"))
            continue
        time.sleep(settle_s)
        if registry.snapshot(source) != before:
            results.append(dict(outcome, status="still being written"))
            continue
        if exclusive is None:
            exclusive = exclusive_create_honoured(destination)
        held = claim(destination, owner, exclusive)
        if held is None:
            results.append(dict(outcome, status="claimed by another watcher"))
            continue
        try:
            report = export(candidate.source, destination_uri, storage_options=storage_options, **options)
            results.append(dict(outcome, status="exported", manifest=report.manifest))
        except ExportError as error:
            log.error("export of %s failed: %s", candidate.source, error)
            results.append(dict(outcome, status="failed", error=str(error)))
        finally:
            destination.delete(held)
    return results


def watch(root: str, pattern: str, dst_template: str, options: dict[str, Any], storage_options: dict[str, Any],
          interval_s: float, settle_s: float = 5.0) -> None:
    """Poll forever: a pass every `interval_s` seconds."""
    while True:
        for result in watch_once(root, pattern, dst_template, options, storage_options, settle_s):
            log.info("%s: %s", result["source"], result["status"])
        time.sleep(interval_s)
