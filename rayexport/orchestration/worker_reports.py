"""What a worker reports to the driver: its measurements and its part of the gather. Plain data
in a module without torch, so that a driver unpickles the reports without importing the worker's
own module (`rayexport.orchestration.workers`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayexport.plan.pieces import Piece


@dataclass
class WorkerStats:
    """One worker's measurements: where it ran, the bytes it read and received, its whole-life
    peak memory and its working memory (the peak above what it held before it loaded anything;
    None where Linux's peak reset is missing), on a GPU the most GPU memory the last transfer
    held, the files it wrote, and the bytes of each pass it made (`rayexport.common.passes`)."""

    worker: int
    node: str
    pid: int
    device: str
    bytes_read: int
    peak_rss_bytes: int
    working_memory_bytes: int | None
    peak_gpu_bytes: int | None
    bytes_received: int = 0
    files_written: list[str] = field(default_factory=list)
    passes: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class WorkerTransfer:
    """What one worker's part of the gather wrote: its files' records (size, digests), the
    digests of the tensors it wrote, its stats, and what it scanned of its pieces as it read
    them (each piece's finiteness and digest)."""

    files: dict[str, dict[str, Any]]
    tensor_digests: dict[str, str]
    stats: WorkerStats
    scanned: dict[Piece, tuple[bool, str | None]] = field(default_factory=dict)
