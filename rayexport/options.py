"""The export's options: one plain dataclass shared by the CLI, `export()` and the manifest."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from rayexport.errors import ExportError
from rayexport.placement import is_whole

BACKENDS = ("auto", "gloo", "nccl")
DTYPES = ("auto", "bfloat16", "float16", "float32")
VERIFY_LEVELS = ("auto", "full", "quick", "none")
# `--verify auto` loads and runs the export (full) up to this many bytes, else checks a sample (quick).
FULL_VERIFY_LIMIT = 8 * 10**9
LORA_MODES = ("merge", "adapter", "both")
LAYOUTS = ("auto", "verl", "dcp")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like '1GiB', '5GB', '500MB' (GB = 10^9, GiB = 2^30)."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(value)
    if not match:
        raise ExportError(f"cannot read size {value!r}; use e.g. 5GB or 512MiB")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(unit.upper() or " "))


@dataclass
class ExportOptions:
    """Everything one export needs to know. Sizes accept ints or strings like '1GiB'."""

    src: str
    dst: str
    workers: int | None = None
    writers: int = 1
    backend: str = "auto"
    bucket_size: int | str = "1GiB"
    max_shard_size: int | str = "5GB"
    dtype: str = "auto"
    trust_remote_code: bool = False
    verify: str = "auto"
    force: bool = False
    timeout_s: float = 1800.0
    deadline_s: float = 86400.0  # the whole export, start to commit
    num_cpus_per_worker: float = 1.0
    # None: one per worker when the backend is (or `auto` picks) nccl, none with gloo
    num_gpus_per_worker: float | None = None
    placement_timeout_s: float = 60.0  # how long the workers may wait for the cluster to place them
    log_level: str = "INFO"
    lora: str = "merge"
    base_model: str | None = None
    lora_alpha: float | None = None
    lora_rslora: bool | None = None
    untie: bool = False
    strict: bool = False
    unsafe_pickle: bool = False
    layout: str = "auto"
    hf_config: str | None = None
    dcp_prefix: str | None = None
    pool: str | None = None  # a warm pool's name: reuse its idle workers, and leave them there
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        checked = (("backend", BACKENDS), ("dtype", DTYPES), ("verify", VERIFY_LEVELS), ("lora", LORA_MODES), ("layout", LAYOUTS))
        for name, allowed in checked:
            if getattr(self, name) not in allowed:
                raise ExportError(f"--{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        self.bucket_size = parse_size(self.bucket_size)
        self.max_shard_size = parse_size(self.max_shard_size)
        if self.workers is not None and self.workers < 1:
            raise ExportError(f"--workers must be at least 1, not {self.workers}")
        if self.timeout_s <= 0 or self.deadline_s <= 0 or self.placement_timeout_s <= 0:
            raise ExportError("--timeout, --deadline and --placement-timeout must be positive")
        gpus = self.num_gpus_per_worker
        if gpus is not None and gpus < 0:
            raise ExportError(f"--num-gpus-per-worker must not be negative, not {gpus:g}")
        if self.backend == "nccl" and gpus is not None and not is_whole(gpus):
            why = "gives it none" if gpus == 0 else "is not a whole number (NCCL refuses two ranks on one device)"
            raise ExportError(f"--backend nccl needs a whole GPU per worker; --num-gpus-per-worker {gpus:g} {why}")
        if self.writers < 1:
            raise ExportError(f"--writers must be at least 1, not {self.writers}")
        if self.bucket_size < 1:
            raise ExportError("--bucket-size must be positive")

    def recorded(self) -> dict[str, Any]:
        """The options that decide the export's bytes, as stored in the manifest (no secrets)."""
        return {
            name: value
            for name, value in dataclasses.asdict(self).items()
            if name in (
                "dtype", "max_shard_size", "trust_remote_code", "verify", "lora", "base_model",
                "lora_alpha", "lora_rslora", "untie", "strict", "dcp_prefix",
            )
        }
