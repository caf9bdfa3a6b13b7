"""The export report: what one export did, for a person (`summary`) and for tools (`to_json`),
and the timing of each of its stages."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from rayexport.common.passes import per_byte

log = logging.getLogger(__name__)


@dataclass
class ExportReport:
    """What an export did: per-stage seconds, bytes and passes over them, peak memory per
    actor, files, verification."""

    source: str
    destination: str
    manifest: str
    layout: str
    world_size: int
    workers: int
    backend: str
    tensor_count: int
    backend_reason: str = ""  # why this backend (and these GPUs): an option, or what was free
    naming: str = ""  # the naming the checkpoint's tensors were saved under (in-memory / on-disk)
    format: str = ""  # the format written
    converted: bool = False  # whether the tensors were renamed, split or merged into that format
    dtype: str = ""  # the dtype floating tensors were written in
    dtype_reason: str = ""  # why that dtype
    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    # per phase, the bytes each kind of pass touched, all workers together (`rayexport.common.passes`)
    passes: dict[str, dict[str, int]] = field(default_factory=dict)
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)
    # per worker: its peak memory above what it held before loading (the transfer window, the
    # verification); "reload": the reload check's process, above what it held once started
    working_memory_bytes: dict[str, int | None] = field(default_factory=dict)
    peak_gpu_bytes: dict[str, int] = field(default_factory=dict)  # per GPU worker: its transfer's peak
    files_by_worker: dict[str, list[str]] = field(default_factory=dict)  # which worker wrote what
    placement: dict[str, dict[str, Any]] = field(default_factory=dict)  # each worker's Ray node and process
    warm_start: bool = False  # the workers came from a warm pool
    # the reload's process, started with the workers or, in a warm pool, after the last export:
    # when (`started_at`, seconds since the epoch), its imports' seconds (`imports_s`) and how long
    # it was ready before the check came (`waited_s`; above 0: its imports were off the path)
    reload_process: dict[str, float] = field(default_factory=dict)
    export_node: str | None = None  # the node whose own disk holds a local destination, on a cluster of several
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    verification: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # checkpoint entries that are not model tensors
    already_committed: bool = False
    # what the plan said the export would cost (`rayexport.plan.cost.ExportCost`, as --dry-run prints it)
    estimate: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def summary(self) -> str:
        """A few lines for a person."""
        if self.already_committed:
            return f"{self.destination} already holds a committed export of {self.source}; nothing to do"
        total = sum(self.seconds.values())
        written = self.bytes.get("written", 0)
        lines = [
            f"exported {self.source}",
            f"      to {self.destination}" + (f" on node {self.export_node}" if self.export_node else ""),
            f"  {self.tensor_count} tensors in {sum(name.endswith('.safetensors') for name in self.files)} "
            f"safetensors file(s), {written / 1e6:.1f} MB, {self.workers} worker(s) over {self.backend} "
            f"({self.backend_reason})",
            f"  {self.format} format" + (f", converted from {self.naming} names" if self.converted else "")
            + f"; {self.dtype} tensors",
            "  seconds: " + ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.seconds.items())
            + f" (total {total:.1f})",
            *passes_lines(self.passes, written),
            *estimate_lines(self.estimate, self.seconds),
            "  peak memory per actor: "
            + ", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in self.peak_rss_bytes.items()),
            f"  verified ({self.verification.get('level')}): " + ", ".join(self.verification.get("checks", {}))
            if self.verification.get("passed") else "  verification skipped (--verify none)",
            *serve_lines(self.verification.get("checks", {})),
            f"  committed: {self.manifest}",
        ]
        return "\n".join(lines)


def passes_lines(passes: dict[str, dict[str, int]], model_bytes: int) -> list[str]:
    """`passes per byte: transfer read 1.0, scanned 1.0, hashed 3.0, ...; ...`, the passes over
    the model's bytes, when they were counted."""
    if not passes or not model_bytes:
        return []
    phases = [
        f"{phase} " + ", ".join(f"{kind} {count:g}" for kind, count in kinds.items())
        for phase, kinds in per_byte(passes, model_bytes).items()
    ]
    return ["  passes per byte: " + "; ".join(phases)]


def estimate_lines(estimate: dict[str, Any], seconds: dict[str, float]) -> list[str]:
    """`estimated seconds (measured): transfer 2.3 (2.9), ...`: the plan's estimate of the
    phases it models beside what they took."""
    planned = estimate.get("seconds", {})
    shown = [name for name in ("transfer", "verify_files", "reload") if name in planned and name in seconds]
    if not shown:
        return []
    return ["  estimated seconds (measured): " + ", ".join(f"{name} {planned[name]:.1f} ({seconds[name]:.1f})" for name in shown)]


def serve_lines(checks: dict[str, Any]) -> list[str]:
    """The summary's line for a serve check that ran (none otherwise)."""
    served = checks.get("vllm")
    if not served:
        return []
    return [
        f"  vllm {served['version']} on {served['device']} ({served['dtype']}): {served['tokens_compared']} generated "
        f"tokens from {served['prompts']} prompts, each transformers' top choice (largest logprob difference "
        f"{served['largest_logprob_difference']:.2g}); load {served['load_s']:.1f} s, generate {served['generate_s']:.1f} s"
    ]


@contextlib.contextmanager
def timed_stage(seconds: dict[str, float], name: str) -> Iterator[dict[str, int]]:
    """Time one stage into `seconds` (a stage timed twice adds up); the body may set
    `moved["bytes"]`, and a stage that ends well logs one line: its bytes, seconds and rate."""
    started = time.perf_counter()
    moved: dict[str, int] = {}
    try:
        yield moved
    finally:
        seconds[name] = round(seconds.get(name, 0.0) + time.perf_counter() - started, 3)
    if "bytes" in moved:
        rate = moved["bytes"] / max(seconds[name], 1e-3)
        log.info("%s: %.2f GB in %.1f s (%.0f MB/s)", name, moved["bytes"] / 1e9, seconds[name], rate / 1e6)
    else:
        log.info("%s: %.1f s", name, seconds[name])
