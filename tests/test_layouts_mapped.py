"""Memory-mapped rank files: the pages a worker has read leave its resident memory, and the page
cache gives them up before the export's own files."""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np
import pytest
import torch  # noqa: F401 - imported ahead, so that its import is not counted in the resident memory below

from rayexport.common.memory import rss_bytes
from rayexport.layouts.mapped import FileMaps, release_pages

MiB = 2**20
KPF_ACTIVE = 6  # the page-flag bit of /proc/kpageflags for a page on the kernel's active list


def test_pages_read_twice_and_given_back_leave_the_process_and_are_not_kept_active(tmp_path):
    """A worker touches each source page twice (the scan, then the pack or the write) and gives
    it back after each step. Unmarked, the kernel takes each give-back as a use and keeps the
    pages on its active list, ahead of the export's files, which the checks read next; marked
    cold, none stays active."""
    path = tmp_path / "rank0.bin"
    path.write_bytes(os.urandom(32 * MiB))
    _drop_from_page_cache(path)
    maps = FileMaps()
    before = rss_bytes()
    for _ in range(2):
        assert int(maps.view(str(path), 0, 32 * MiB, "uint8").amax()) > 0
        release_pages(maps.ranges())
        assert rss_bytes() - before < 8 * MiB
    if not os.access("/proc/kpageflags", os.R_OK):
        pytest.skip("/proc/kpageflags needs Linux and root: which pages are active cannot be read here")
    assert _active_fraction(path) == 0.0


def _drop_from_page_cache(path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def _active_fraction(path) -> float:
    """The share of the file's cached pages on the kernel's active list, found by mapping it
    again, here, and looking its pages' frames up (a fault maps a page without marking it used)."""
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    values = np.frombuffer(mapped, dtype=np.uint8)
    pages = len(mapped) // mmap.PAGESIZE
    int(values[::mmap.PAGESIZE].sum())  # map each page in
    first = values.ctypes.data // mmap.PAGESIZE
    active = 0
    with open("/proc/self/pagemap", "rb") as pagemap, open("/proc/kpageflags", "rb") as flags:
        for page in range(pages):
            pagemap.seek((first + page) * 8)
            frame = struct.unpack("<Q", pagemap.read(8))[0] & ((1 << 55) - 1)
            flags.seek(frame * 8)
            active += (struct.unpack("<Q", flags.read(8))[0] >> KPF_ACTIVE) & 1
    del values
    mapped.close()
    return active / pages
