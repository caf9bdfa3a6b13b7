"""What an export must hold, as the exporter recorded it: written to the manifest and read back
from it, with the tensors whose values a level checks."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from rayexport.common.digests import FAST, manifest_algorithm
from rayexport.common.levels import FULL, Level, reads_whole_files
from rayexport.plan.formats import ON_DISK, Format
from rayexport.verification.serving import ServeRequest

QUICK_SAMPLE = 16


@dataclass
class ExpectedExport:
    """What an export must hold: recorded by the exporter while writing (files, tensors) and
    by the workers from the source shards before the gather (`pieces`: per output tensor, the
    digest of each source piece after the planned cast, at its offset; with `lora`, of the piece
    merged with its LoRA adapter). Every record holds its digest under the name of the hash,
    `digest` (see `rayexport.common.digests`)."""

    files: dict[str, dict[str, Any]]
    tensors: dict[str, dict[str, Any]]
    tied: list[tuple[str, str]] = field(default_factory=list)
    adapter: bool = False
    pieces: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    level: Level = FULL
    trust_remote_code: bool = False
    format: Format = ON_DISK  # the tensor format written
    source_finite: bool = True  # False: the checkpoint itself held NaN/Inf, exported with a warning
    # True when each file's and each of its tensors' digests were taken by the writer over the
    # same bytes in this run (never for records read back from a manifest, which may have been
    # edited since): a file whose digest matches then holds every tensor's recorded bytes
    written_together: bool = False
    serve: ServeRequest | None = None  # the serve check the user asked for (not in the manifest)
    digest: str = FAST
    # tensors the export holds that transformers' model class has no place for, which its reload
    # leaves out (multi-token-prediction layers, for vLLM's and SGLang's speculative decoding)
    beyond_model: list[str] = field(default_factory=list)

    def to_manifest(self) -> dict[str, Any]:
        """The parts of the manifest `from_manifest` reads back."""
        return {
            "digest": self.digest, "files": self.files, "tensors": self.tensors, "tied": [list(pair) for pair in self.tied],
            "adapter": self.adapter, "source_pieces": self.pieces, "source_finite": self.source_finite,
            "beyond_model": self.beyond_model,
        }

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], level: Level | None = None) -> "ExpectedExport":
        """What the committed export of `manifest` must hold, checked at `level` (default: the
        level it was verified at)."""
        options = manifest.get("options", {})
        return cls(
            files=manifest["files"], tensors=manifest["tensors"],
            tied=[tuple(pair) for pair in manifest.get("tied", [])], adapter=manifest.get("adapter", False),
            pieces=manifest.get("source_pieces", {}), level=level or manifest.get("verification", {}).get("level", FULL),
            trust_remote_code=options.get("trust_remote_code", False),
            format=options.get("format", ON_DISK),
            source_finite=manifest.get("source_finite", True),
            digest=manifest_algorithm(manifest),
            beyond_model=manifest.get("beyond_model", []),
        )

    def sample(self) -> list[str]:
        """The tensors whose values are checked: all of them, or with `quick` a deterministic
        sample (by a hash of the name, so a re-run checks the same ones) that holds a LoRA-merged
        tensor whenever there is one (a merge bug shows in each of them)."""
        names = sorted(self.tensors)
        if reads_whole_files(self.level):
            return names
        ranked = sorted(names, key=lambda name: hashlib.sha256(name.encode()).hexdigest())
        sample = ranked[:QUICK_SAMPLE]
        merged = [name for name in ranked if any(piece.get("lora") for piece in self.pieces.get(name, []))]
        if merged and not set(merged) & set(sample):
            sample[-1] = merged[0]
        return sample
