"""The range reads every check streams an export's files with: the same bytes from a local file
(memory-mapped, its pages given back as it goes) as from S3 (ranges in flight), fewer where the
file ends first."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch  # noqa: F401 - imported ahead, so that its import is not counted in the resident memory below

from rayexport.common.digests import digest_of, new_digest
from rayexport.common.memory import rss_bytes
from rayexport.storage.settings import storage_options_from_env
from rayexport.storage.store import Store
from rayexport.verification.reading import stream_ranges

MiB = 2**20


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path, s3_prefix):
    if request.param == "local":
        return Store(str(tmp_path / "out"))
    return Store(s3_prefix, storage_options_from_env())


def test_ranges_stream_the_files_bytes_and_stop_where_it_ends(store):
    data = os.urandom(3 * MiB + 5)
    store.write_bytes("model.safetensors", data)
    store.write_bytes("empty.json", b"")
    ranges = [(0, 8), (8, MiB + 3), (MiB + 3, 3 * MiB), (3 * MiB, 3 * MiB + 64)]  # the last past the end
    with contextlib.closing(stream_ranges(store, "model.safetensors", ranges)) as blocks:
        assert [bytes(block) for block in blocks] == [data[start:end] for start, end in ranges]
    assert [bytes(block) for block in stream_ranges(store, "empty.json", [(0, 4)])] == [b""]


def test_a_local_file_streams_without_its_pages_staying_in_the_process(tmp_path):
    """A file larger than the memory a check may hold is read in place: what the process holds
    of it is the range being read, whatever the file's size."""
    data = os.urandom(96 * MiB)
    (tmp_path / "model.safetensors").write_bytes(data)
    ranges = [(start, start + 16 * MiB) for start in range(0, len(data), 16 * MiB)]
    digest, before, grown = new_digest(), rss_bytes(), 0
    for block in stream_ranges(Store(str(tmp_path)), "model.safetensors", ranges):
        digest.update(block)
        grown = max(grown, rss_bytes() - before)
    assert digest.hexdigest() == digest_of(data)
    assert grown < 40 * MiB
