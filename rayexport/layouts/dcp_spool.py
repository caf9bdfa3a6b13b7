"""A worker's share of a DCP checkpoint in one local spool file: tensors (or chunks of them)
read by `torch.distributed.checkpoint.load` without a process group, each chunk copied straight
into its place in the memory-mapped file, checked for NaN and Inf, and its pages given back, so
that the worker holds about one chunk at a time while it reads. torch's storage readers are
handed the `.metadata` that `dcp_metadata` unpickled from its allow-list (`storage_reader`)."""

from __future__ import annotations

import io
import mmap
import os
import tempfile
import warnings
from typing import Callable

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from rayexport.common.dtypes import dtype_name, dtype_of
from rayexport.common.errors import ExportError
from rayexport.layouts.base import Advance, MappedTensors
from rayexport.layouts.dcp_metadata import DcpTensor, reason
from rayexport.layouts.mapped import release_pages
from rayexport.plan.shards import ShardInfo
from rayexport.storage.store import Store

# Where tensors start in a worker's spool file: a multiple of every dtype's size.
SPOOL_ALIGNMENT = 64


def spool(
    store: Store, metadata: Metadata, wanted: list[DcpTensor], spool_dir: str,
    chunk_offsets: dict[str, tuple[int, ...]] | None = None,
) -> tuple[dict[str, torch.Tensor], str]:
    """Read `wanted` (whole tensors, or with `chunk_offsets` the chunks starting there) into a
    new spool file: their views by stored key, and the file's path."""
    offsets, size = spool_offsets(wanted)
    path = _new_spool_file(spool_dir, size, store.uri)
    try:
        spool = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        state = {tensor.key: _view(spool, offset, tensor) for tensor, offset in zip(wanted, offsets)}
        _load_into(store, metadata, state, chunk_offsets)
    except BaseException:
        os.remove(path)
        raise
    return state, path


class SpooledTensors(MappedTensors):
    """A worker's share of a DCP checkpoint: whole tensors by model key, views of one spool file
    mapped into this process (read from disk only when touched)."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], path: str | None,
        chunks: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
    ) -> None:
        super().__init__(tensors, path)
        self.chunks = chunks or {}  # model key -> (offset, global shape), for chunks of tensors

    def describe(self, advance: Advance = lambda count: None) -> dict[str, ShardInfo]:
        """Every tensor: a plain, whole tensor, or a chunk placed in its tensor."""
        infos = {}
        for key, tensor in self.tensors.items():
            offset, global_shape = self.chunks.get(key, (None, None))
            infos[key] = ShardInfo(
                local_shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype),
                global_shape=global_shape, offset=offset,
            )
            advance(tensor.nbytes)
        return infos


def spool_offsets(tensors: list[DcpTensor]) -> tuple[list[int], int]:
    """Where each tensor starts in a spool file, each aligned for any dtype, and the file's size
    (never 0, which `posix_fallocate` refuses)."""
    offsets, position = [], 0
    for tensor in tensors:
        offsets.append(position)
        position += -(-tensor.nbytes // SPOOL_ALIGNMENT) * SPOOL_ALIGNMENT
    return offsets, max(position, SPOOL_ALIGNMENT)


def _new_spool_file(spool_dir: str, size: int, uri: str) -> str:
    """A new file of `size` bytes in `spool_dir`, its blocks allocated now where the OS can
    (Linux): a full disk is an error here, not a SIGBUS when a write through the mapping finds no
    block."""
    handle, path = tempfile.mkstemp(prefix="dcp-", suffix=".tensors", dir=spool_dir)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(handle, 0, size)
        else:
            os.ftruncate(handle, size)
    except OSError as error:
        os.remove(path)
        raise ExportError(
            f"cannot make a {size}-byte spool file in '{spool_dir}' for DCP checkpoint '{uri}': {reason(error)}"
        ) from None
    finally:
        os.close(handle)
    return path


def _view(spool: torch.Tensor, offset: int, tensor: DcpTensor) -> torch.Tensor:
    data = spool[offset:offset + tensor.nbytes]
    return data.view(dtype_of(tensor.dtype)).reshape(tensor.shape)


def _load_into(
    store: Store, metadata: Metadata, state: dict[str, torch.Tensor],
    chunk_offsets: dict[str, tuple[int, ...]] | None = None,
) -> None:
    """Fill `state` (stored keys to views of the spool) with one `load`, chunk by chunk, giving
    back each chunk's pages once it has landed. With `chunk_offsets`, each view is the one saved
    chunk of its tensor that starts there."""

    def landed(key: str, chunk: torch.Tensor) -> None:
        release_pages([page_span(state[key])])

    try:
        with warnings.catch_warnings():
            # load() warns that it assumes a single process when no process group exists: intended.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            reader = storage_reader(store, metadata)
            planner = _WatchingPlanner(landed) if chunk_offsets is None else _ChunkPlanner(landed, chunk_offsets)
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - torch and storage clients raise many types
        error = unwrap(error)
        if isinstance(error, FileNotFoundError):
            missing = os.path.basename(str(error.filename or error.args[-1]))
            raise ExportError(f"DCP checkpoint '{store.uri}' is missing '{missing}'") from None
        raise ExportError(f"cannot read DCP checkpoint '{store.uri}': {reason(error)}") from None


class _WatchingPlanner(DefaultLoadPlanner):
    """torch's load planner, calling `landed(stored key, region)` once each chunk is copied to its
    region of the tensor."""

    def __init__(self, landed: Callable[[str, torch.Tensor], None]) -> None:
        super().__init__()
        self.landed = landed

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        self.landed(read_item.dest_index.fqn, tensor)


class _ChunkPlanner(_WatchingPlanner):
    """The watching planner for views that each hold one saved chunk (starting at
    `offsets[key]`), not a whole tensor: it plans the reads of those chunks alone."""

    def __init__(self, landed: Callable[[str, torch.Tensor], None], offsets: dict[str, tuple[int, ...]]) -> None:
        super().__init__(landed)
        self.offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, view in self.state_dict.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets[key]), sizes=view.size())
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


def page_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses of a contiguous tensor's bytes, widened to whole pages."""
    start = tensor.data_ptr()
    return start - start % mmap.PAGESIZE, start + tensor.nbytes


def storage_reader(store: Store, metadata: Metadata):
    """torch's storage reader for `store` (plain files when local, fsspec otherwise), handed
    the `metadata` that `read_metadata` read instead of fetching `.metadata` again."""
    if store.is_local:
        reader = _CheckedFileSystemReader(store.path())
    else:
        protocol = fsspec.core.split_protocol(store.uri)[0]
        # The same options the Store opened its filesystem with, so fsspec reuses that instance.
        options = store.options if protocol in ("s3", "s3a") else {}
        reader = _CheckedFsspecReader(store.uri, **options)
    reader.known_metadata = metadata
    return reader


class _CheckedMetadataReading:
    """torch's reader, but with the `.metadata` that `read_metadata` read through the Store and
    unpickled with an allow-list: torch's own `read_metadata` is a bare `pickle.load`, which
    runs whatever code the file holds."""

    known_metadata: Metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self.known_metadata.storage_meta.load_id = self.load_id
        return self.known_metadata


class _CheckedFileSystemReader(_CheckedMetadataReading, FileSystemReader):
    pass


class _CheckedFsspecReader(_CheckedMetadataReading, FsspecReader):
    def _slice_file(self, file, sinfo) -> io.BytesIO:
        """One chunk's bytes, fetched with one ranged request through the filesystem of `file`
        (an fsspec buffered file). torch reads a view of the open file instead, through fsspec's
        read-ahead cache (50 MiB blocks on s3fs): each worker would fetch most of every rank file,
        and hold a block beside each chunk."""
        end = sinfo.offset + sinfo.length
        return io.BytesIO(file.fs.cat_file(file.path, start=sinfo.offset, end=end))


def unwrap(error: BaseException) -> BaseException:
    """The first rank's own exception from a CheckpointException, which load() raises, even
    without a process group, for any failure while planning or reading (and which derives from
    BaseException, not Exception)."""
    if isinstance(error, CheckpointException) and error.failures:
        wrapped = next(iter(error.failures.values()))
        return wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return error
