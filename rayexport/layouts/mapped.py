"""Memory-mapped source files: where a worker maps each one from (a remote file spooled to its
local disk first), and giving back the pages it has already read.

Pages of a mapped file that a process has touched count in its resident memory until it
unmaps them, so a worker streaming a 10 GB rank file would end up "holding" 10 GB. Telling
the kernel they are not needed (madvise) drops them from the process; the file stays in the
page cache and a later read maps the pages back in. torch maps rank files privately and
nothing here ever writes to a source tensor, so dropping the pages loses nothing.

Each page is also marked cold first. A worker touches each source page more than once (the
scan, then the pack or the write), and unmapping a page it touched counts as a use: without
the mark the kernel would keep the source, read once and done with, in preference to the
export's own files, which the file check and the reload read next. Where both do not fit
the page cache (a 36 GB ZeRO save exported to 12 GB on a 24 GiB machine), those re-reads
then went to the disk: 12 GB of them, against 0.1-3.6 GB with the mark.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import TYPE_CHECKING, Any, Callable

from rayexport.common.errors import ExportError
from rayexport.common.dtypes import dtype_of
from rayexport.storage.store import Store

if TYPE_CHECKING:
    import torch

MADV_DONTNEED = 4
MADV_COLD = 20  # Linux 5.4 and later; an older kernel refuses it, and only the hint is lost


def local_file(store: Store, name: str, spool_dir: str, progress: Callable[[int], Any] = lambda count: None) -> str:
    """The local path a worker maps `name` from: the file itself in a local store, else its copy
    downloaded into `spool_dir` (`progress` gets each count of bytes spooled), so that a remote
    file too is memory-mapped rather than held in RAM."""
    if store.is_local:
        if not os.path.exists(store.path(name)):
            raise ExportError(f"not found: '{store.display(name)}'")
        return store.path(name)
    path = os.path.join(spool_dir, name)
    store.download(name, path, progress)
    return path


def map_range(path: str, offset: int, count: int, dtype: str) -> torch.Tensor:
    """`count` elements of `dtype` at byte `offset` of the file `path`, memory-mapped
    copy-on-write (nothing is read until touched; `offset` need not be aligned)."""
    import numpy as np
    import torch

    torch_dtype = dtype_of(dtype)
    if count == 0:
        return torch.empty(0, dtype=torch_dtype)
    raw = np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(count * torch_dtype.itemsize,))
    return torch.from_numpy(raw).view(torch_dtype)


class FileMaps:
    """Files memory-mapped whole, copy-on-write, each once however many views are taken of it:
    a checkpoint of many chunks (a 235B model's tens of thousands) costs a mapping per file,
    not per chunk, and its pages are given back with one call per file."""

    def __init__(self) -> None:
        self.maps: dict[str, Any] = {}

    def view(self, path: str, offset: int, count: int, dtype: str) -> torch.Tensor:
        """`count` elements of `dtype` at byte `offset` of `path` (which need not be aligned)."""
        import numpy as np
        import torch

        torch_dtype = dtype_of(dtype)
        if count == 0:
            return torch.empty(0, dtype=torch_dtype)
        if path not in self.maps:
            self.maps[path] = np.memmap(path, dtype=np.uint8, mode="c")
        raw = self.maps[path][offset:offset + count * torch_dtype.itemsize]
        return torch.from_numpy(raw).view(torch_dtype)

    def ranges(self) -> list[tuple[int, int]]:
        """The address range of each mapped file, for `release_pages`."""
        return [(mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes) for mapped in self.maps.values()]


def mapped_ranges(path: str) -> list[tuple[int, int]]:
    """The address ranges at which this process maps `path` (Linux; empty elsewhere)."""
    target = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == target:
                    start, end = (int(address, 16) for address in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return ranges


def release_pages(ranges: list[tuple[int, int]]) -> None:
    """Drop the resident pages of these (never written) file mappings from this process, marked
    as the first the page cache should give up."""
    if not ranges:
        return
    madvise = _libc().madvise
    for start, end in ranges:
        for advice in (MADV_COLD, MADV_DONTNEED):
            madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)  # the C library this process already has loaded
