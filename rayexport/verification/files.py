"""The file checks: re-reading an export's files by byte ranges, streamed, against what the
exporter recorded (each file's size and digest, each tensor's header entry and digest) and
against the source (each tensor's source pieces), with the hash the manifest names
(`rayexport.common.digests`). Each writer runs them on the files it wrote."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

from rayexport.common.digests import LEGACY, new_digest
from rayexport.common.dtypes import TORCH_NAME_OF_CODE, dtype_of, nbytes
from rayexport.common.errors import one_line
from rayexport.common.levels import reads_whole_files
from rayexport.common.passes import Count, ignore
from rayexport.storage.store import Store
from rayexport.transport.writer import tensor_bytes
from rayexport.verification import VerificationError
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.reading import READ_BLOCK, is_weights_file, read_header, stream_ranges

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


def check_files(
    store: Store, names: list[str], expected: ExpectedExport, progress: Callable[[int], Any] = lambda count: None,
    count: Count = ignore,
) -> list[FileCheck]:
    """Re-read the export's files `names` at `store`, by byte ranges, streamed: each file's size
    and digest (with `quick`, the small files' only), each weight file's header against the
    recorded tensors, and each checked tensor's digest and source pieces (every tensor, or with
    `quick` the sampled ones, of which only their bytes are read). `progress` gets each count
    of bytes read, `count` the bytes of each pass."""
    sample = set(expected.sample())
    if expected.digest == LEGACY:  # an old manifest's digests are SHA-256: counted as such
        count = _renamed(count, "hashed", "hashed_sha256")
    return [_check_file(store, name, expected, sample, progress, count) for name in names]


def _renamed(count: Count, kind: str, as_kind: str) -> Count:
    """`count`, with the bytes of `kind` counted as `as_kind`."""
    return lambda counted, nbytes: count(as_kind if counted == kind else counted, nbytes)


def _check_file(
    store: Store, name: str, expected: ExpectedExport, sample: set[str], progress, count: Count,
) -> FileCheck:
    check = FileCheck(name)
    if not store.exists(name):
        check.missing = True
        check.problems.append(f"integrity: file {name} is missing")
        return check
    size = store.size(name)
    record = expected.files.get(name, {})
    algorithm = expected.digest
    if not is_weights_file(name):
        digest = _read_through(store, name, [(0, size, None)], check, progress, count, new_digest(algorithm))
        _check_digest(check, record, size, digest, algorithm)
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
    whole_file = reads_whole_files(expected.level)
    checked = sorted(
        (key for key in header if key in sample and key in expected.tensors), key=lambda key: header[key]["data_offsets"][0]
    )
    # The tensors' own digests are left to the file's where the writer took both over the same
    # bytes: one pass fewer over every byte (taken after all, to name them, if the file's fails).
    by_file = whole_file and expected.written_together

    def tensor_check(key: str, pieces: list[dict[str, Any]], own_digest: bool = True) -> _TensorCheck:
        return _TensorCheck(key, *check.tensors[key], pieces, algorithm, own_digest)

    tensors = {key: tensor_check(key, expected.pieces.get(key, []), not by_file) for key in checked}
    reads = _tensor_reads(header, data_start, checked, size if whole_file else None)
    digest = _read_through(store, name, reads, check, progress, count, new_digest(algorithm) if whole_file else None, tensors)
    if whole_file and not _check_digest(check, record, size, digest, algorithm) and by_file:
        digests = {key: tensor_check(key, []) for key in checked}
        reads = _tensor_reads(header, data_start, checked, None)
        _read_through(store, name, reads, FileCheck(name), progress, count, None, digests)
        for key in checked:
            check.problems += digests[key].problems(expected.tensors[key].get(algorithm))
    for key in checked:
        check.problems += tensors[key].problems(expected.tensors[key].get(algorithm))
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


def _check_digest(check: FileCheck, record: dict[str, Any], size: int, digest, algorithm: str) -> bool:
    """Whether the file's size and digest are the recorded ones; a problem when not."""
    if digest.hexdigest() == record.get(algorithm) and size == record.get("size"):
        return True
    check.problems.append(f"integrity: file {check.name} does not match its recorded {algorithm} digest")
    return False


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
    store: Store, name: str, reads: list[Read], check: FileCheck, progress: Callable[[int], Any], count: Count,
    file_digest: Any = None, tensors: dict[str, "_TensorCheck"] | None = None,
) -> Any:
    """Read `reads` in order (`stream_ranges`), feeding the file's digest and each tensor's
    check; returns the file's digest."""
    with contextlib.closing(stream_ranges(store, name, [(start, end) for start, end, _ in reads])) as blocks:
        for item, data in zip(reads, blocks):
            _consume(data, item, check, progress, count, file_digest, tensors)
    return file_digest


def _consume(data, item: Read, check: FileCheck, progress, count: Count, file_digest, tensors) -> None:
    start, end, where = item
    if len(data) != end - start:
        raise VerificationError(f"integrity: file {check.name} ended at byte {start + len(data)} while being read")
    check.bytes_read += len(data)
    progress(len(data))
    count("read", len(data))
    if file_digest is not None:
        file_digest.update(data)
        count("hashed", len(data))
    if where is not None:
        count("hashed", tensors[where[0]].update(where[1], data))


class _TensorCheck:
    """The digests of one tensor and of the source pieces it must hold, fed blocks of its rows
    in order: a piece's bytes in C order are its rows' parts one after another."""

    def __init__(
        self, key: str, dtype: str, shape: tuple[int, ...], pieces: list[dict[str, Any]], algorithm: str,
        own_digest: bool = True,
    ) -> None:
        self.key, self.dtype, self.shape, self.algorithm = key, dtype, shape, algorithm
        self.digest = new_digest(algorithm) if own_digest else None  # None: the file's digest covers it
        self.pieces = [(piece, new_digest(algorithm)) for piece in pieces]

    def update(self, first_row: int, data: bytes) -> int:
        """Feed the next block of the tensor's bytes, whole rows from `first_row` on; returns
        the bytes hashed (its own digest and its pieces')."""
        hashed = 0
        if self.digest is not None:
            self.digest.update(data)
            hashed += len(data)
        if not self.pieces:
            return hashed
        if not self.shape:  # a scalar: each piece is all of it
            for _, digest in self.pieces:
                digest.update(data)
            return hashed + len(data) * len(self.pieces)
        row = nbytes(self.shape[1:], self.dtype)
        block_rows = len(data) // row
        values = None
        for piece, digest in self.pieces:
            offset, extent = piece["offset"], piece["shape"]
            if len(offset) == 1 and len(self.shape) != 1:  # a run of the flattened tensor: its bytes
                element, begin = nbytes((), self.dtype), first_row * row
                low, high = max(begin, offset[0] * element), min(begin + len(data), (offset[0] + extent[0]) * element)
                if low < high:
                    digest.update(memoryview(data)[low - begin:high - begin])
                    hashed += high - low
                continue
            start, stop = max(first_row, offset[0]), min(first_row + block_rows, offset[0] + extent[0])
            if start >= stop:
                continue
            steps = piece.get("steps") or [1] * len(offset)  # along every axis but the first (`Tile.target_steps`)
            if list(offset[1:]) == [0] * (len(offset) - 1) and list(extent[1:]) == list(self.shape[1:]) and max(steps) == 1:
                digest.update(memoryview(data)[(start - first_row) * row:(stop - first_row) * row])
                hashed += (stop - start) * row
                continue
            if values is None:
                import torch

                values = torch.frombuffer(bytearray(data), dtype=dtype_of(self.dtype)).view(block_rows, *self.shape[1:])
            region = (slice(start - first_row, stop - first_row),) + tuple(
                slice(begin, begin + (length - 1) * step + 1, step) for begin, length, step in zip(offset[1:], extent[1:], steps[1:])
            )
            box = tensor_bytes(values[region])
            digest.update(box)
            hashed += len(box)
        return hashed

    def problems(self, recorded: str | None) -> list[str]:
        """Once every row is fed: the tensor's digest against the recorded one, each piece's
        against its source's."""
        found = []
        if self.digest is not None and self.digest.hexdigest() != recorded:
            found.append(f"integrity: tensor '{self.key}' does not match its recorded digest")
        for piece, digest in self.pieces:
            if digest.hexdigest() != piece.get(self.algorithm):
                found.append(
                    f"fidelity: tensor '{self.key}' at offset {piece['offset']} differs from "
                    f"rank {piece['rank']}'s '{piece['source_key']}'"
                    + (" merged with its LoRA adapter" if piece.get("lora") else "")
                )
        return found
