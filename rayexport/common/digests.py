"""The digests an export compares: one fast 128-bit hash on every path, chosen here.

Every comparison the export makes (each source piece's digest against its bytes in the written
file, each tensor's and each file's digest against a re-read of the destination) guards
against accidental corruption between reading, sending, writing and reading back, not against
someone forging a file, so it uses xxh3-128 (the `xxhash` library, several GB/s a core here)
instead of SHA-256 (about 1.6 GB/s a core). A manifest names the hash its records hold
(`digest`); one written before it did holds SHA-256 (`LEGACY`), and is still checked with it.
SHA-256 of each file, what `sha256sum` and the Hub's LFS pointers use, is taken only when
asked for (`--sha256`) and recorded beside the fast digest.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import xxhash

FAST = "xxh3_128"
LEGACY = "sha256"  # manifests of format rayexport/1 (no `digest` field)
ALGORITHMS: dict[str, Callable[[], Any]] = {FAST: xxhash.xxh3_128, LEGACY: hashlib.sha256}


def new_digest(algorithm: str = FAST) -> Any:
    """A running hash of `algorithm` (`update(bytes)`, `hexdigest()`)."""
    try:
        return ALGORITHMS[algorithm]()
    except KeyError:
        raise ValueError(f"unknown digest algorithm '{algorithm}' (known: {', '.join(ALGORITHMS)})") from None


def digest_of(data: Any, algorithm: str = FAST) -> str:
    """The hex digest of one buffer."""
    digest = new_digest(algorithm)
    digest.update(data)
    return digest.hexdigest()


def manifest_algorithm(manifest: dict[str, Any]) -> str:
    """The hash a manifest's records hold, each under its name: `digest`, or SHA-256 in a
    manifest written before it was recorded."""
    return manifest.get("digest", LEGACY)
