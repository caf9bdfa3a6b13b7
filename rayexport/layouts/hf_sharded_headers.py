"""The headers of torch's sharded HF safetensors files: each piece a file holds (where it starts
in its tensor, as `HuggingFaceStorageWriter` records it in `DCP_SHARDING_INFO`), and each
tensor's full shape from its pieces, which must cover it exactly once. Pure functions, but for
reading a header by byte ranges."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from rayexport.common.dtypes import TORCH_NAME_OF_CODE
from rayexport.common.errors import ExportError, one_line
from rayexport.storage.store import Store

HEADER_READ = 64 * 1024  # a first read of each file that holds a small model's whole header
MAX_HEADER = 100_000_000  # the largest header the safetensors library reads


@dataclass(frozen=True)
class Piece:
    """One file's piece of one tensor: where it starts in the full tensor, its shape and dtype."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str  # torch's name


def read_header(store: Store, name: str) -> dict[str, Piece]:
    """The pieces the file `name` holds, from its safetensors header, read by byte ranges (no
    library parses a remote file's header)."""
    where = store.display(name)
    head = store.read_range(name, 0, HEADER_READ)
    try:
        (length,) = struct.unpack("<Q", head[:8])
        if length > MAX_HEADER:
            raise ValueError(f"a header of {length} bytes")
        if len(head) < 8 + length:
            head += store.read_range(name, len(head), 8 + length)
        header = json.loads(head[8:8 + length])
        entries = {key: (entry["shape"], entry["dtype"]) for key, entry in header.items() if key != "__metadata__"}
    except (struct.error, ValueError, TypeError, KeyError, AttributeError) as error:
        raise ExportError(f"'{where}' is not a safetensors file: {one_line(error)}") from None
    return header_pieces(entries, header.get("__metadata__"), where)


def header_pieces(entries: dict[str, tuple[list[int], str]], metadata: dict | None, where: str) -> dict[str, Piece]:
    """Pieces from a header's tensors (key -> shape, safetensors dtype code) and its metadata,
    where HuggingFaceStorageWriter records each piece's offsets."""
    from torch.distributed.checkpoint._hf_utils import CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY  # see dcp_metadata

    try:
        offsets = json.loads((metadata or {})[CUSTOM_METADATA_KEY])
        pieces = {
            key: Piece(tuple(offsets[key][SAVED_OFFSETS_KEY]), tuple(shape), TORCH_NAME_OF_CODE[code])
            for key, (shape, code) in entries.items()
        }
    except (KeyError, TypeError, ValueError):
        raise ExportError(f"'{where}' records no piece offsets ({CUSTOM_METADATA_KEY}) for all its tensors") from None
    bad = next((key for key, piece in pieces.items() if len(piece.offset) != len(piece.shape)), None)
    if bad is not None:
        raise ExportError(f"tensor '{bad}' in '{where}' has offsets {list(pieces[bad].offset)} for shape {list(pieces[bad].shape)}")
    return pieces


def full_shape(key: str, pieces: dict[str, Piece]) -> tuple[int, ...]:
    """The shape of tensor `key` from its pieces (file -> piece): where they end. Raises unless
    they have one dtype and rank and cover it exactly once."""
    (first_file, first), *_ = pieces.items()
    for name, piece in pieces.items():
        if (piece.dtype, len(piece.shape)) != (first.dtype, len(first.shape)):
            raise ExportError(f"tensor '{key}' is {first.dtype} {list(first.shape)} in '{first_file}' but {piece.dtype} {list(piece.shape)} in '{name}'")
    shape = tuple(max(piece.offset[dim] + piece.shape[dim] for piece in pieces.values()) for dim in range(len(first.shape)))
    solid = sorted((piece.offset, piece.shape, name) for name, piece in pieces.items() if math.prod(piece.shape))
    for index, (offset, size, name) in enumerate(solid):
        for other_offset, other_size, other in solid[index + 1:]:
            if offset and other_offset[0] >= offset[0] + size[0]:
                break  # sorted by offset: no later piece reaches back into this one
            if all(a < b + m and b < a + n for a, n, b, m in zip(offset, size, other_offset, other_size)):
                raise ExportError(f"tensor '{key}' has overlapping pieces in '{name}' and '{other}'")
    covered = sum(math.prod(size) for _, size, _ in solid)
    if covered != math.prod(shape):
        raise ExportError(f"tensor '{key}' pieces cover {covered} of its {math.prod(shape)} elements {list(shape)}")
    return shape
