"""Reading objects robustly: a read made again while its response body breaks off, and a
download of one object as several byte ranges in flight at once."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
from typing import Any, Callable

from rayexport.common.errors import one_line

log = logging.getLogger(__name__)

# A download fetches this many ranges of DOWNLOAD_BLOCK at once, each written at its offset as
# it arrives: at most 4 x 16 MiB = 64 MiB in memory per download.
DOWNLOAD_BLOCK = 16 * 2**20
DOWNLOAD_RANGES_IN_FLIGHT = 4

# A response whose body breaks off after its request succeeded (BODY_ERRORS): botocore's retries
# end with the response, so a read is made again, this many times in all. A request that fails is
# botocore's to retry, and is never retried again here.
READ_ATTEMPTS = 3


def _body_errors() -> tuple[type[BaseException], ...]:
    """`rayexport.storage.s3.BODY_ERRORS`; none before s3fs is loaded, since only its reads raise them."""
    if "s3fs" not in sys.modules:
        return ()
    from rayexport.storage.s3 import BODY_ERRORS

    return BODY_ERRORS


def read_retrying(read, *args, **kwargs) -> bytes:
    """`read(*args, **kwargs)`, made again (READ_ATTEMPTS in all) while its body breaks off."""
    for _ in range(READ_ATTEMPTS - 1):
        try:
            return read(*args, **kwargs)
        except _body_errors() as error:
            log.info("reading again after a response broke off: %s", one_line(error))
    return read(*args, **kwargs)


def copy_ranges(source: Any, fd: int, progress: Callable[[int], Any]) -> None:
    """Copy the whole of the open remote file `source` into the local file `fd`, DOWNLOAD_BLOCK
    at a time and DOWNLOAD_RANGES_IN_FLIGHT blocks at once, each written at its offset as it
    arrives; `progress` gets each count of bytes copied."""
    starts = range(0, source.size, DOWNLOAD_BLOCK)
    _run_all(lambda start: _copy_range(source, start, fd), starts, DOWNLOAD_RANGES_IN_FLIGHT, progress)


def _copy_range(source: Any, start: int, fd: int) -> int:
    """Copy the block of the open remote file `source` at `start` to the same offset of `fd`;
    return its length."""
    end = min(start + DOWNLOAD_BLOCK, source.size)
    data = memoryview(read_retrying(source._fetch_range, start, end))
    if len(data) != end - start:
        raise EOFError(f"the object ended at byte {start + len(data)} of {source.size}")
    length = len(data)
    while data:
        written = os.pwrite(fd, data, start)
        data, start = data[written:], start + written
    return length


def _run_all(function, items, workers: int, on_result: Callable[[Any], Any] = lambda result: None) -> None:
    """Call `function` on every item, `workers` at a time, handing each result to `on_result`
    as it comes; the first failure cancels the calls not yet started and is raised (rather than
    waiting for every remaining call to fail too)."""
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(function, item) for item in items]
        try:
            for future in concurrent.futures.as_completed(futures):
                on_result(future.result())
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise


