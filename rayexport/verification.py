"""Verification: the checks an export must pass before its manifest is written.

Every check reads the destination itself, by byte ranges, streamed; nothing downloads the
export. `check_files` re-reads some of the export's files (each writer runs it on the files it
wrote, all of them at once), `conclude` puts what they found together with the index, and the
reload check (rayexport.reload_check) runs transformers in a process of its own. Problems are
reported structure first, then integrity, then fidelity, so the first names the most basic
thing wrong.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE

from rayexport.dtypes import TORCH_NAME_OF_CODE, dtype_of, nbytes
from rayexport.errors import ExportError, one_line
from rayexport.plan.formats import ON_DISK
from rayexport.storage import Store
from rayexport.writer import tensor_bytes

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


READ_BLOCK = 16 * 2**20  # bytes per range read; a tensor is read a block of whole rows at a time
READ_AHEAD = 4  # range reads in flight per file, so a remote destination streams at link rate
MAX_HEADER = 100 * 2**20  # the safetensors library refuses longer headers too
STAGES = ("structure", "integrity", "fidelity")  # the order problems are reported in
Read = tuple[int, int, "tuple[str, int] | None"]  # [start, end) and the tensor and first row it holds


@dataclass
class FileCheck:
    """What re-reading one file of an export found: its tensors as its header describes them
    (weight files), what was checked, and each problem, as one line starting with its stage."""

    name: str
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # key -> (dtype, shape)
    missing: bool = False
    bytes_read: int = 0
    digests_checked: int = 0
    pieces_checked: int = 0
    problems: list[str] = field(default_factory=list)


def is_weights_file(name: str) -> bool:
    return name.endswith(".safetensors")


def read_header(store: Store, name: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """Where the data of the safetensors file `name` starts, and each tensor's header entry
    (dtype, shape, data_offsets), read by byte range; ValueError naming what is malformed."""
    prefix = store.read_range(name, 0, 8)
    if len(prefix) != 8:
        raise ValueError("the file is shorter than its 8-byte header length")
    length = int.from_bytes(prefix, "little")
    if length > MAX_HEADER:
        raise ValueError(f"a header length of {length} bytes")
    text = store.read_range(name, 8, 8 + length)
    if len(text) != length:
        raise ValueError("the file ends inside its header")
    header = json.loads(text)
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    for key, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            size = nbytes(entry["shape"], TORCH_NAME_OF_CODE[entry["dtype"]])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor '{key}' has a malformed header entry") from None
        if end - begin != size or begin < 0:
            raise ValueError(f"tensor '{key}' has data_offsets that do not fit its shape and dtype")
    return 8 + length, header


def check_files(
    store: Store, names: list[str], expected: ExpectedExport, progress: Callable[[int], Any] = lambda count: None
) -> list[FileCheck]:
    """Re-read the export's files `names` at `store`, by byte ranges, streamed: each file's size
    and sha256 (with `quick`, the small files' only), each weight file's header against the
    recorded tensors, and each checked tensor's digest and source pieces (every tensor, or with
    `quick` the sampled ones, of which only their bytes are read). `progress` gets each count
    of bytes read."""
    sample = set(expected.sample())
    return [_check_file(store, name, expected, sample, progress) for name in names]


def _check_file(store: Store, name: str, expected: ExpectedExport, sample: set[str], progress) -> FileCheck:
    check = FileCheck(name)
    if not store.exists(name):
        check.missing = True
        check.problems.append(f"integrity: file {name} is missing")
        return check
    size = store.size(name)
    record = expected.files.get(name, {})
    if not is_weights_file(name):
        digest = _read_through(store, name, [(0, size, None)], check, progress, hashlib.sha256())
        _check_digest(check, record, size, digest)
        return check
    try:
        data_start, header = read_header(store, name)
        _check_extent(header, data_start, size)
    except ValueError as error:
        check.problems.append(f"structure: shard {name} cannot be parsed: {one_line(error)}")
        return check
    check.tensors = {key: (TORCH_NAME_OF_CODE[entry["dtype"]], tuple(entry["shape"])) for key, entry in header.items()}
    for key, (dtype, shape) in check.tensors.items():
        recorded = expected.tensors.get(key)
        if recorded is None:
            check.problems.append(f"integrity: tensor '{key}' in {name} was never written")
        elif list(shape) != list(recorded["shape"]) or dtype != recorded["dtype"]:
            check.problems.append(f"integrity: tensor '{key}' has the wrong shape or dtype")
    whole_file = expected.level != "quick"
    checked = sorted(
        (key for key in header if key in sample and key in expected.tensors), key=lambda key: header[key]["data_offsets"][0]
    )
    tensors = {key: _TensorCheck(key, *check.tensors[key], expected.pieces.get(key, [])) for key in checked}
    reads = _tensor_reads(header, data_start, checked, size if whole_file else None)
    digest = _read_through(store, name, reads, check, progress, hashlib.sha256() if whole_file else None, tensors)
    if whole_file:
        _check_digest(check, record, size, digest)
    for key in checked:
        check.problems += tensors[key].problems(expected.tensors[key]["sha256"])
    check.digests_checked = len(checked)
    check.pieces_checked = sum(len(tensor.pieces) for tensor in tensors.values())
    return check


def _check_extent(header: dict[str, dict[str, Any]], data_start: int, size: int) -> None:
    """The tensors' data fills the file after the header, end to end, without overlaps."""
    position = 0
    for begin, end in sorted(entry["data_offsets"] for entry in header.values()):
        if begin < position:
            raise ValueError("two tensors' data overlap")
        position = end
    if data_start + position != size:
        raise ValueError(f"its header describes {data_start + position} bytes, the file holds {size}")


def _check_digest(check: FileCheck, record: dict[str, Any], size: int, digest) -> None:
    if digest.hexdigest() != record.get("sha256") or size != record.get("size"):
        check.problems.append(f"integrity: file {check.name} does not match its recorded sha256")


def _tensor_reads(
    header: dict[str, dict[str, Any]], data_start: int, keys: list[str], whole_file_size: int | None
) -> list[Read]:
    """The byte ranges to read, in file order, each with the tensor and first row it holds: the
    tensors `keys` a block of whole rows at a time, and, given the file's size, everything else
    too (header and any other tensor), so that the whole file streams through once."""
    wanted = set(keys)
    reads: list[Read] = []
    position = 0
    for key, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        begin, end = (data_start + offset for offset in entry["data_offsets"])
        if key not in wanted:
            continue
        if whole_file_size is not None and position < begin:
            reads += [(start, min(start + READ_BLOCK, begin), None) for start in range(position, begin, READ_BLOCK)]
        rows = entry["shape"][0] if entry["shape"] else 1
        row_bytes = (end - begin) // rows if rows else 0
        step = max(1, READ_BLOCK // row_bytes) if row_bytes else 1
        reads += [
            (begin + row * row_bytes, begin + min(row + step, rows) * row_bytes, (key, row)) for row in range(0, rows, step)
        ] if row_bytes else []
        position = end
    if whole_file_size is not None and position < whole_file_size:
        reads += [(start, min(start + READ_BLOCK, whole_file_size), None) for start in range(position, whole_file_size, READ_BLOCK)]
    return reads


def _read_through(
    store: Store, name: str, reads: list[Read], check: FileCheck, progress: Callable[[int], Any],
    file_digest: Any = None, tensors: dict[str, "_TensorCheck"] | None = None,
) -> Any:
    """Read `reads` in order (a few ranges ahead, in threads), feeding the file's digest and
    each tensor's check; returns the file's digest."""
    with ThreadPoolExecutor(READ_AHEAD) as pool:
        pending: deque = deque()
        for item in reads:
            pending.append((pool.submit(store.read_range, name, item[0], item[1]), item))
            if len(pending) > READ_AHEAD:
                _consume(*pending.popleft(), check, progress, file_digest, tensors)
        while pending:
            _consume(*pending.popleft(), check, progress, file_digest, tensors)
    return file_digest


def _consume(future, item: Read, check: FileCheck, progress, file_digest, tensors) -> None:
    data = future.result()
    start, end, where = item
    if len(data) != end - start:
        raise VerificationError(f"integrity: file {check.name} ended at byte {start + len(data)} while being read")
    check.bytes_read += len(data)
    progress(len(data))
    if file_digest is not None:
        file_digest.update(data)
    if where is not None:
        tensors[where[0]].update(where[1], data)


class _TensorCheck:
    """The digests of one tensor and of the source pieces it must hold, fed blocks of its rows
    in order: a piece's bytes in C order are its rows' parts one after another."""

    def __init__(self, key: str, dtype: str, shape: tuple[int, ...], pieces: list[dict[str, Any]]) -> None:
        self.key, self.dtype, self.shape = key, dtype, shape
        self.digest = hashlib.sha256()
        self.pieces = [(piece, hashlib.sha256()) for piece in pieces]

    def update(self, first_row: int, data: bytes) -> None:
        self.digest.update(data)
        if not self.pieces:
            return
        if not self.shape:  # a scalar: each piece is all of it
            for _, digest in self.pieces:
                digest.update(data)
            return
        row = nbytes(self.shape[1:], self.dtype)
        block_rows = len(data) // row
        values = None
        for piece, digest in self.pieces:
            offset, extent = piece["offset"], piece["shape"]
            start, stop = max(first_row, offset[0]), min(first_row + block_rows, offset[0] + extent[0])
            if start >= stop:
                continue
            if list(offset[1:]) == [0] * (len(offset) - 1) and list(extent[1:]) == list(self.shape[1:]):
                digest.update(memoryview(data)[(start - first_row) * row:(stop - first_row) * row])
                continue
            if values is None:
                values = torch.frombuffer(bytearray(data), dtype=dtype_of(self.dtype)).view(block_rows, *self.shape[1:])
            region = (slice(start - first_row, stop - first_row),) + tuple(
                slice(begin, begin + length) for begin, length in zip(offset[1:], extent[1:])
            )
            digest.update(tensor_bytes(values[region]))

    def problems(self, recorded_sha256: str) -> list[str]:
        found = []
        if self.digest.hexdigest() != recorded_sha256:
            found.append(f"integrity: tensor '{self.key}' does not match its recorded digest")
        for piece, digest in self.pieces:
            if digest.hexdigest() != piece["sha256"]:
                found.append(
                    f"fidelity: tensor '{self.key}' at offset {piece['offset']} differs from "
                    f"rank {piece['rank']}'s '{piece['source_key']}'"
                    + (" merged with its LoRA adapter" if piece.get("lora") else "")
                )
        return found


def index_shards(store: Store) -> list[str]:
    """The weight files the export's index (or its single file) names, after checking the names."""
    if not store.exists(SAFETENSORS_INDEX_FILE):
        if not store.exists(SAFETENSORS_SINGLE_FILE):
            raise VerificationError(f"structure: neither {SAFETENSORS_INDEX_FILE} nor {SAFETENSORS_SINGLE_FILE} exists")
        return [SAFETENSORS_SINGLE_FILE]
    weight_map = _index(store)["weight_map"]
    names = sorted(set(weight_map.values()))
    for name in names:
        if not isinstance(name, str) or not SHARD_NAME.match(name):
            raise VerificationError(f"structure: index names an invalid shard file {name!r}")
    return names


def _index(store: Store) -> dict[str, Any]:
    try:
        index = json.loads(store.read_bytes(SAFETENSORS_INDEX_FILE))
        if not isinstance(index["weight_map"], dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError) as error:
        raise VerificationError(f"structure: {SAFETENSORS_INDEX_FILE} is not a valid index: {error}") from None
    return index


def check_structure(store: Store, checks: list[FileCheck], expected: ExpectedExport) -> list[str]:
    """The problems of the export's layout, from its index and the headers the file checks
    read: every shard the index names exists, no tensor is in two shards, the index maps each
    tensor to the shard holding it, total_size is right, no stray weight file lies beside the
    shards, and no recorded tensor is missing."""
    by_name = {check.name: check for check in checks}
    names = index_shards(store)
    problems = [
        f"structure: shard {name} named by the index is missing" for name in names if name not in by_name or by_name[name].missing
    ]
    seen: dict[str, str] = {}
    for name in names:
        for key in by_name[name].tensors if name in by_name else ():
            if key in seen:
                problems.append(f"structure: tensor '{key}' is in both {seen[key]} and {name}")
            seen.setdefault(key, name)
    if store.exists(SAFETENSORS_INDEX_FILE):
        index = _index(store)
        weight_map = index["weight_map"]
        if set(weight_map) != set(seen) or any(seen[key] != shard for key, shard in weight_map.items()):
            key = sorted(set(weight_map) ^ set(seen) or weight_map)[0]
            problems.append(f"structure: index and shards disagree about tensor '{key}'")
        total = sum(nbytes(by_name[seen[key]].tensors[key][1], by_name[seen[key]].tensors[key][0]) for key in seen)
        if index.get("metadata", {}).get("total_size") != total:
            problems.append(
                f"structure: index total_size {index.get('metadata', {}).get('total_size')} != {total} bytes of tensors"
            )
    stray = sorted(name for name in store.list() if name.endswith((".safetensors", ".bin", ".pt")) and name not in names)
    problems += [f"structure: stray weight file {name}" for name in stray[:1]]
    held = {key for check in checks for key in check.tensors}
    problems += [f"integrity: tensor '{key}' is missing from the export" for key in sorted(set(expected.tensors) - held)[:1]]
    return problems


def conclude(store: Store, checks: list[FileCheck], expected: ExpectedExport) -> dict[str, Any]:
    """Put the file checks of every writer together with the structure check: raise
    VerificationError with the first problem, structure before integrity before fidelity, else
    return each check's numbers."""
    problems = [problem for check in checks for problem in check.problems] + check_structure(store, checks, expected)
    problems.sort(key=lambda problem: STAGES.index(problem.split(":", 1)[0]))  # stable: a file's own first
    if problems:
        raise VerificationError(problems[0])
    weights = [check for check in checks if is_weights_file(check.name)]
    return {
        "structure": {
            "shards": len(index_shards(store)), "tensors": sum(len(check.tensors) for check in weights),
            "bytes": sum(nbytes(shape, dtype) for check in weights for dtype, shape in check.tensors.values()),
        },
        "files": {"files": len(checks), "bytes_read": sum(check.bytes_read for check in checks)},
        "tensors": {"tensors": sum(len(check.tensors) for check in weights), "digests_checked": sum(check.digests_checked for check in checks)},
        "fidelity": {"pieces_checked": sum(check.pieces_checked for check in checks)},
    }


def verify_export(store: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int) -> dict[str, Any]:
    """Run every check on the export at `store` from this process (reading its files a few at a
    time in threads, then the reload); raise VerificationError on the first failure, else
    return each check's numbers. An export's own verification spreads the file checks over its
    writers instead (rayexport.group)."""
    from rayexport.reload_check import check_reload

    with ThreadPoolExecutor(READ_AHEAD) as pool:
        checks = [part for parts in pool.map(lambda name: check_files(store, [name], expected), sorted(expected.files)) for part in parts]
    found = conclude(store, checks, expected)
    found["reload"] = check_reload(store, expected, timeout_s, memory_bound_bytes)
    return {"passed": True, "level": expected.level, "checks": found}
