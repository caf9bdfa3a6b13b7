"""Memory-mapped source files: give back the pages a worker has already read.

Pages of a mapped file that a process has touched count in its resident memory until it
unmaps them, so a worker streaming a 10 GB rank file would end up "holding" 10 GB. Telling
the kernel they are not needed (madvise) drops them from the process; the file stays in the
page cache and a later read maps the pages back in. torch maps rank files privately and
nothing here ever writes to a source tensor, so dropping the pages loses nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os

MADV_DONTNEED = 4


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
    """Drop the resident pages of these (never written) file mappings from this process."""
    if not ranges:
        return
    madvise = _libc().madvise
    for start, end in ranges:
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)  # the C library this process already has loaded
