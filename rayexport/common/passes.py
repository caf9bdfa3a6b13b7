"""Passes over bytes: how many bytes each phase of an export read, copied, scanned, hashed,
sent and wrote, counted where it happens, so the report shows where each second goes.

Kinds of pass:
- `read`: bytes read from storage (a rank file's pages, a destination file's ranges);
- `scanned`: values checked for NaN/Inf;
- `hashed`: bytes fed to the fast digest (once per digest: a file's and a tensor's digest
  over the same bytes count twice); `hashed_sha256`: to SHA-256 (`--sha256`, old manifests);
- `copied`: bytes copied in memory (a cast, packing a send buffer, assembling a tensor from
  boxes, a strided view made contiguous);
- `sent` and `received`: over the process group;
- `written`: bytes handed to storage.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Callable, Iterable

Count = Callable[[str, int], None]  # (kind, bytes)


def ignore(kind: str, nbytes: int) -> None:
    """A counter that counts nothing (a caller that does not measure)."""


class Passes:
    """Bytes by phase and kind of pass, added to as the passes run (from any thread: a writer
    counts in its own thread while the gather counts in the worker's)."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.lock = threading.Lock()

    def counter(self, phase: str) -> Count:
        """A function that adds (kind, bytes) to `phase`."""
        counts = self.counts[phase]

        def count(kind: str, nbytes: int) -> None:
            if nbytes:
                with self.lock:
                    counts[kind] += nbytes

        return count

    def snapshot(self) -> dict[str, dict[str, int]]:
        """The counts so far, as plain dicts."""
        with self.lock:
            return {phase: dict(kinds) for phase, kinds in self.counts.items() if kinds}


def summed(counts: Iterable[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Several processes' counts added up, phase by phase and kind by kind."""
    total: dict[str, dict[str, int]] = {}
    for one in counts:
        for phase, kinds in one.items():
            for kind, nbytes in kinds.items():
                total.setdefault(phase, {}).setdefault(kind, 0)
                total[phase][kind] += nbytes
    return total


def per_byte(counts: dict[str, dict[str, int]], model_bytes: int) -> dict[str, dict[str, float]]:
    """Each count as passes over the model's bytes (2.0: every byte twice)."""
    return {
        phase: {kind: round(nbytes / model_bytes, 2) for kind, nbytes in kinds.items()}
        for phase, kinds in counts.items()
    } if model_bytes else {}
