"""Reading an export's safetensors files by byte range: the header, the shard-name rule, and
the streamed range reads every check reads a file with, their size and their depth."""

from __future__ import annotations

import json
import mmap
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator

from rayexport.common.dtypes import TORCH_NAME_OF_CODE, nbytes
from rayexport.storage.store import Store

SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
READ_BLOCK = 16 * 2**20  # bytes per range read; a tensor is read a block of whole rows at a time
READ_AHEAD = 4  # range reads in flight per file, so a remote destination streams at link rate
PAGE = mmap.PAGESIZE
MAX_HEADER = 100 * 2**20  # the safetensors library refuses longer headers too


def is_weights_file(name: str) -> bool:
    """Whether the export's file `name` is a safetensors file (its header describes tensors)."""
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


def stream_ranges(store: Store, name: str, ranges: Iterable[tuple[int, int]]) -> Iterator[memoryview | bytes]:
    """The bytes of each [start, end) of `ranges` of the object `name`, in order, fewer where it
    ends first. A local file is memory-mapped and each range is a view of it, valid until the
    next is asked for, when its pages leave this process (they stay in the page cache): no copy,
    and the kernel's read-ahead streams it. A remote object is read in threads, READ_AHEAD
    ranges in flight while the caller uses the one before them, so that it streams at the link's
    rate."""
    if store.is_local:
        yield from _mapped_ranges(store.map_file(name), ranges)
        return
    with ThreadPoolExecutor(READ_AHEAD) as pool:
        pending: deque = deque()
        for start, end in ranges:
            pending.append(pool.submit(store.read_range, name, start, end))
            if len(pending) > READ_AHEAD:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _mapped_ranges(mapped: mmap.mmap | None, ranges: Iterable[tuple[int, int]]) -> Iterator[memoryview | bytes]:
    """`stream_ranges` over a file mapped whole (None: an empty one)."""
    for start, end in ranges:
        if mapped is None:
            yield b""
            continue
        view = memoryview(mapped)[start:end]
        yield view
        view.release()
        first = start - start % PAGE
        if first < len(mapped):
            mapped.madvise(mmap.MADV_DONTNEED, first, min(end, len(mapped)) - first)
