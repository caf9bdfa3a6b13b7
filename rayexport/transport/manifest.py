"""The commit object: `export_manifest.json`, written last. Without it an export does not exist."""

from __future__ import annotations

import datetime
from typing import Any

from rayexport.storage.store import Store

MANIFEST_NAME = "export_manifest.json"
# 2: every digest is the one `digest` names (xxh3_128); 1: SHA-256, no `digest` field
MANIFEST_FORMAT = "rayexport/2"


def build_manifest(
    *,
    source: str,
    layout: str,
    world_size: int,
    options: dict[str, Any],
    expected: dict[str, Any],
    verification: dict[str, Any],
) -> dict[str, Any]:
    """The manifest's content: what was exported and how; the hash its digests use, every
    file's size and digest (and SHA-256 with `--sha256`), every tensor's dtype, shape and
    digest, the tied pairs and the source pieces' digests (what `rayexport.verify` checks
    again); and the verification result."""
    return {
        "format": MANIFEST_FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "layout": layout,
        "world_size": world_size,
        "options": options,
        "tensor_count": len(expected["tensors"]),
        **{key: dict(sorted(value.items())) if isinstance(value, dict) else value for key, value in expected.items()},
        "verification": verification,
    }


def read_manifest(store: Store) -> dict[str, Any] | None:
    """The committed manifest at `store`, or None when there is no committed export."""
    if not store.exists(MANIFEST_NAME):
        return None
    return store.read_json(MANIFEST_NAME)


def commit(store: Store, manifest: dict[str, Any]) -> None:
    """Write the manifest, the export's single commit point."""
    store.write_json(MANIFEST_NAME, manifest)
