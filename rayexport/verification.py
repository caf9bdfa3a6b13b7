"""Verification: the checks an export must pass before its manifest is written.

Structure and integrity are read from the destination alone; loadability runs transformers in
a separate process without storage credentials (remote code executes on import).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE

from rayexport.dtypes import SAFETENSORS_DTYPES, TORCH_NAME_OF_CODE, nbytes
from rayexport.errors import ExportError
from rayexport.lora import ADAPTER_WEIGHTS
from rayexport.plan.formats import ON_DISK
from rayexport.storage import Store

SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


class VerificationError(ExportError):
    """An export failed a check; the message names the check and the tensor or file."""


QUICK_SAMPLE = 16


@dataclass
class ExpectedExport:
    """What an export must hold: recorded by the exporter while writing (files, tensors) and
    by the workers from the source shards before the gather (`pieces`: per output tensor, the
    sha256 of each source piece after the planned cast, at its offset; with `lora`, of the piece
    merged with its LoRA adapter)."""

    files: dict[str, dict[str, Any]]
    tensors: dict[str, dict[str, Any]]
    tied: list[tuple[str, str]] = field(default_factory=list)
    adapter: bool = False
    pieces: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    level: str = "full"
    trust_remote_code: bool = False
    format: str = ON_DISK  # the tensor format written (plan/formats.py)
    source_finite: bool = True  # False: the checkpoint itself held NaN/Inf, exported with a warning

    def to_manifest(self) -> dict[str, Any]:
        """The parts of the manifest `from_manifest` reads back."""
        return {
            "files": self.files, "tensors": self.tensors, "tied": [list(pair) for pair in self.tied],
            "adapter": self.adapter, "source_pieces": self.pieces, "source_finite": self.source_finite,
        }

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], level: str | None = None) -> "ExpectedExport":
        options = manifest.get("options", {})
        return cls(
            files=manifest["files"], tensors=manifest["tensors"],
            tied=[tuple(pair) for pair in manifest.get("tied", [])], adapter=manifest.get("adapter", False),
            pieces=manifest.get("source_pieces", {}), level=level or manifest.get("verification", {}).get("level", "full"),
            trust_remote_code=options.get("trust_remote_code", False),
            format=options.get("format", ON_DISK),
            source_finite=manifest.get("source_finite", True),
        )

    def sample(self) -> list[str]:
        """The tensors whose values are checked: all of them, or with `quick` a deterministic
        sample (by a hash of the name, so a re-run checks the same ones) that holds a LoRA-merged
        tensor whenever there is one (a merge bug shows in each of them)."""
        names = sorted(self.tensors)
        if self.level != "quick":
            return names
        ranked = sorted(names, key=lambda name: hashlib.sha256(name.encode()).hexdigest())
        sample = ranked[:QUICK_SAMPLE]
        merged = [name for name in ranked if any(piece.get("lora") for piece in self.pieces.get(name, []))]
        if merged and not set(merged) & set(sample):
            sample[-1] = merged[0]
        return sample


def shard_names(local_dir: str) -> list[str]:
    """The weight files an export's index (or single file) names, after checking the names."""
    index_path = os.path.join(local_dir, SAFETENSORS_INDEX_FILE)
    if not os.path.exists(index_path):
        if not os.path.exists(os.path.join(local_dir, SAFETENSORS_SINGLE_FILE)):
            raise VerificationError(f"structure: neither {SAFETENSORS_INDEX_FILE} nor {SAFETENSORS_SINGLE_FILE} exists")
        return [SAFETENSORS_SINGLE_FILE]
    try:
        with open(index_path) as handle:
            weight_map = json.load(handle)["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise VerificationError(f"structure: {SAFETENSORS_INDEX_FILE} is not a valid index: {error}") from None
    names = sorted(set(weight_map.values()))
    for name in names:
        if not isinstance(name, str) or not SHARD_NAME.match(name):
            raise VerificationError(f"structure: index names an invalid shard file {name!r}")
    return names


def check_structure(local_dir: str) -> dict[str, Any]:
    """Every shard exists and parses, no key twice, index == union of shards, total_size right,
    no stray weight files."""
    from safetensors import safe_open

    names = shard_names(local_dir)
    seen: dict[str, str] = {}
    total = 0
    for name in names:
        path = os.path.join(local_dir, name)
        if not os.path.exists(path):
            raise VerificationError(f"structure: shard {name} named by the index is missing")
        try:
            with safe_open(path, framework="pt") as handle:
                for key in handle.keys():
                    if key in seen:
                        raise VerificationError(f"structure: tensor '{key}' is in both {seen[key]} and {name}")
                    seen[key] = name
                    sliced = handle.get_slice(key)
                    total += nbytes(sliced.get_shape(), TORCH_NAME_OF_CODE[sliced.get_dtype()])
        except VerificationError:
            raise
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error types
            raise VerificationError(f"structure: shard {name} cannot be parsed: {error}") from None
    if len(names) > 1 or os.path.exists(os.path.join(local_dir, SAFETENSORS_INDEX_FILE)):
        with open(os.path.join(local_dir, SAFETENSORS_INDEX_FILE)) as handle:
            index = json.load(handle)
        if set(index["weight_map"]) != set(seen) or any(
            seen[key] != shard for key, shard in index["weight_map"].items()
        ):
            key = sorted(set(index["weight_map"]) ^ set(seen) or index["weight_map"])[0]
            raise VerificationError(f"structure: index and shards disagree about tensor '{key}'")
        if index.get("metadata", {}).get("total_size") != total:
            raise VerificationError(
                f"structure: index total_size {index.get('metadata', {}).get('total_size')} "
                f"!= {total} bytes of tensors"
            )
    stray = sorted(
        name for name in os.listdir(local_dir)
        if name.endswith((".safetensors", ".bin", ".pt")) and name not in names
    )
    if stray:
        raise VerificationError(f"structure: stray weight file {stray[0]}")
    return {"shards": len(names), "tensors": len(seen), "bytes": total}


def check_files(local_dir: str, expected: ExpectedExport) -> dict[str, Any]:
    """Every recorded file has its recorded size and sha256."""
    for name, record in sorted(expected.files.items()):
        path = os.path.join(local_dir, name)
        if not os.path.exists(path):
            raise VerificationError(f"integrity: file {name} is missing")
        digest = _file_sha256(path)
        if digest != record["sha256"] or os.path.getsize(path) != record["size"]:
            raise VerificationError(f"integrity: file {name} does not match its recorded sha256")
    return {"files": len(expected.files)}


def weight_files(local_dir: str, expected: ExpectedExport) -> list[str]:
    return shard_names(local_dir) + ([ADAPTER_WEIGHTS] if expected.adapter else [])


def check_tensors(local_dir: str, expected: ExpectedExport) -> dict[str, Any]:
    """The files hold exactly the recorded tensors, each with its dtype and shape, and every
    sampled tensor read back has the digest the exporter recorded while writing."""
    from safetensors import safe_open

    from rayexport.writer import tensor_bytes

    sample, found = set(expected.sample()), set()
    for name in weight_files(local_dir, expected):
        with safe_open(os.path.join(local_dir, name), framework="pt") as handle:
            for key in handle.keys():
                record = expected.tensors.get(key)
                if record is None:
                    raise VerificationError(f"integrity: tensor '{key}' in {name} was never written")
                sliced = handle.get_slice(key)
                if list(sliced.get_shape()) != list(record["shape"]) or sliced.get_dtype() != SAFETENSORS_DTYPES[record["dtype"]]:
                    raise VerificationError(f"integrity: tensor '{key}' has the wrong shape or dtype")
                if key in sample and hashlib.sha256(tensor_bytes(handle.get_tensor(key))).hexdigest() != record["sha256"]:
                    raise VerificationError(f"integrity: tensor '{key}' does not match its recorded digest")
                found.add(key)
    missing = sorted(set(expected.tensors) - found)
    if missing:
        raise VerificationError(f"integrity: tensor '{missing[0]}' is missing from the export")
    return {"tensors": len(found), "digests_checked": len(sample)}


def check_fidelity(local_dir: str, expected: ExpectedExport) -> dict[str, Any]:
    """Every sampled tensor, sliced where each source piece belongs, equals that piece as the
    workers read it from the source (after the planned cast): a swap of two same-shaped tensors,
    a misplaced shard or a wrong cast shows here, independently of the exporter's own digests."""
    from safetensors import safe_open

    from rayexport.writer import tensor_bytes

    file_of = {}
    for name in weight_files(local_dir, expected):
        with safe_open(os.path.join(local_dir, name), framework="pt") as handle:
            file_of.update(dict.fromkeys(handle.keys(), name))
    checked = 0
    for tensor_name in expected.sample():
        pieces = expected.pieces.get(tensor_name)
        if not pieces:
            continue  # exported with --verify none: no source digests were recorded
        with safe_open(os.path.join(local_dir, file_of[tensor_name]), framework="pt") as handle:
            sliced = handle.get_slice(tensor_name)
            for piece in pieces:
                region = tuple(slice(start, start + size) for start, size in zip(piece["offset"], piece["shape"]))
                values = sliced[region] if region else handle.get_tensor(tensor_name)
                if hashlib.sha256(tensor_bytes(values)).hexdigest() != piece["sha256"]:
                    raise VerificationError(
                        f"fidelity: tensor '{tensor_name}' at offset {piece['offset']} differs from "
                        f"rank {piece['rank']}'s '{piece['source_key']}'"
                        + (" merged with its LoRA adapter" if piece.get("lora") else "")
                    )
                checked += 1
    return {"pieces_checked": checked}


def verify_export(dst: Store, expected: ExpectedExport, timeout_s: float) -> dict[str, Any]:
    """Run every check on the export at `dst`; raise VerificationError on the first failure,
    else return each check's numbers."""
    from rayexport.reload_check import check_reload

    with tempfile.TemporaryDirectory(prefix="rayexport-verify-") as scratch:
        local_dir = dst.path() if dst.is_local else _download_all(dst, scratch)
        checks = {
            "structure": check_structure(local_dir),
            "files": check_files(local_dir, expected),
            "tensors": check_tensors(local_dir, expected),
            "fidelity": check_fidelity(local_dir, expected),
            "reload": check_reload(local_dir, expected, timeout_s),
        }
    return {"passed": True, "level": expected.level, "checks": checks}


def _download_all(store: Store, local_dir: str) -> str:
    store.fs.invalidate_cache(store.path())
    for name in store.fs.find(store.path()):
        relative = os.path.relpath(name, store.path())
        target = os.path.join(local_dir, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        store.download(relative, target)
    return local_dir


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
