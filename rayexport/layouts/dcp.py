"""PyTorch Distributed Checkpoint (DCP) layout: `__{rank}_{n}.distcp` files plus `.metadata`, as
FSDP2 training loops, torchtitan, accelerate and `torch.distributed.checkpoint.save` write them.

Everything goes through torch's own DCP machinery: its storage reader parses `.metadata` (every
key's global shape, dtype and chunks), and `torch.distributed.checkpoint.load` without a process
group fills whole tensors from whichever chunks of whichever rank files hold them. A remote
checkpoint is read in place with torch's fsspec reader, one ranged request per chunk. A worker's
tensors land, a chunk at a time, in one local spool file it memory-maps, so that its memory stays
at about a chunk while it reads, and at the transfer window after.
"""

from __future__ import annotations

import mmap
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from rayexport.dtypes import dtype_name, dtype_of
from rayexport.errors import ExportError
from rayexport.layouts.base import (
    HF_DIR, Advance, Checkpoint, KeyMapping, Loaded, LoadStep, SourceSettings, SourceTensors, marker_snapshot,
)
from rayexport.layouts.dcp_metadata import (
    DCP_METADATA, NON_MODEL_NAMES, DcpTensor, describe_entry, detect_prefix, first_name, read_metadata, reason,
    storage_reader, unwrap,
)
from rayexport.layouts.mapped import mapped_ranges, release_pages
from rayexport.layouts.shards import ShardInfo
from rayexport.plan.naming import model_names
from rayexport.plan.schedule import assign_by_bytes, keep_ties_together
from rayexport.scan import CHUNK_ELEMENTS, is_finite
from rayexport.storage import Store

# Where tensors start in a worker's spool file: a multiple of every dtype's size.
SPOOL_ALIGNMENT = 64
_DISTCP_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class DcpCheckpoint(Checkpoint):
    """The model tensors of one DCP checkpoint directory; any reader can read any whole tensor."""

    keys: KeyMapping = field(default_factory=KeyMapping)  # stored keys -> model keys
    tensors: dict[str, DcpTensor] = field(default_factory=dict)  # by model key
    unsafe_pickle: bool = False
    spools_remote_files = False  # a worker reads ranges of remote files into a spool of its own

    @property
    def prefix(self) -> str:
        return self.keys.prefix

    def share(self, num_workers: int, aliases: dict[str, str], load: LoadStep) -> Loaded:
        """Each worker reads a byte-balanced share of whole tensors, tied copies together, and
        holds them as its own pseudo-rank."""
        name_of = {key: name for name, key in model_names(self.tensors)[0].items()}
        sizes = {key: tensor.nbytes for key, tensor in self.tensors.items()}
        assignment = keep_ties_together(assign_by_bytes(sizes, num_workers), aliases, name_of)
        rank_infos = load({worker: (worker, keys) for worker, keys in enumerate(assignment) if keys})
        holders = {key: {rank: infos[key]} for rank, infos in rank_infos.items() for key in infos}
        return Loaded(rank_infos, holders, {worker: worker for worker in range(num_workers)})

    def part_bytes(self, part: tuple[int, list[str]]) -> int:
        """The bytes of the tensors of `part` (pseudo-rank, model keys)."""
        return sum(self.tensors[key].nbytes for key in part[1])

    def read(self, part: tuple[int, list[str]], spool_dir: str, spooled: Advance) -> dict[int, SourceTensors]:
        """The whole tensors of `part` (pseudo-rank, model keys), read into this worker's spool."""
        rank, keys = part
        return {rank: read_tensors(self, keys, spool_dir)}


class DcpLayout:
    """PyTorch Distributed Checkpoint directories (FSDP2 loops, torchtitan, RL trainers' DCP saves)."""

    name = "dcp"

    def detect(self, store: Store, names: list[str]) -> bool:
        return DCP_METADATA in names or any(_DISTCP_FILE.match(name) for name in names)

    def describe(self, store: Store, settings: SourceSettings) -> DcpCheckpoint:
        return find_dcp_checkpoint(store, settings.key_prefix, unsafe_pickle=settings.unsafe_pickle)

    def snapshot(self, store: Store, names: list[str]) -> dict[str, int] | None:
        return marker_snapshot(store, names, DCP_METADATA)  # DCP writes .metadata last


def find_dcp_checkpoint(
    store: Store, prefix: str | None = None, *, unsafe_pickle: bool = False,
    mapping: Callable[[str], KeyMapping] = KeyMapping,
) -> DcpCheckpoint:
    """Describe the model tensors of the DCP checkpoint at `store` from its `.metadata`.

    `prefix` is the part of the stored keys to strip to get model keys ("model.", "app.model.",
    "" ...; a missing final "." is added); by default it is detected from how the state dict was
    nested when saved. `mapping` makes the layout's `KeyMapping` from the prefix. Optimizer,
    scheduler and other training state, and every non-tensor entry, go to `skipped`. Raises
    ExportError when `.metadata` is missing or unreadable, or no model tensor is found.

    `.metadata` is a pickle: it is unpickled allowing only the classes DCP metadata is made of,
    unless `unsafe_pickle`, which unpickles it as torch does, running any code it holds.
    """
    metadata = read_metadata(store, unsafe_pickle)
    entries = metadata.state_dict_metadata
    tensor_keys = [key for key, value in entries.items() if isinstance(value, TensorStorageMetadata)]
    if not tensor_keys:
        raise ExportError(f"DCP checkpoint '{store.uri}' holds no tensors")
    if prefix is None:
        prefix = detect_prefix(tensor_keys, metadata.planner_data, store.uri)
    elif prefix and not prefix.endswith("."):
        prefix += "."
    keys = mapping(prefix)
    tensors: dict[str, DcpTensor] = {}
    skipped = [key for key, value in entries.items() if not isinstance(value, TensorStorageMetadata)]
    for key in tensor_keys:
        model_key = keys.model_key(key)
        if not model_key or first_name(model_key) in NON_MODEL_NAMES:
            skipped.append(key)
            continue
        tensors[model_key] = describe_entry(store, key, entries[key])
    if not tensors:
        raise ExportError(f"no model tensors under key prefix '{prefix}' in DCP checkpoint '{store.uri}'")
    ranks = {match.group(1) for match in map(_DISTCP_FILE.match, store.list()) if match}
    return DcpCheckpoint(
        store=store, world_size=len(ranks), layout="dcp",
        hf_folder=store.child(HF_DIR),
        skipped=sorted(skipped), keys=keys, tensors=tensors, unsafe_pickle=unsafe_pickle,
    )


def read_tensors(checkpoint: DcpCheckpoint, keys: list[str], spool_dir: str) -> SpooledTensors:
    """Read the whole tensors `keys` (model keys) into one local file in `spool_dir`, memory-mapped;
    return them keyed by model key, with whether each is finite.

    `torch.distributed.checkpoint.load` runs without a process group and reads only the chunks
    of these tensors, from local files or, for a remote store, with one ranged request each.
    Each chunk is copied straight into its place in the mapped spool file, checked for NaN and
    Inf, and its pages given back, so this process holds about one chunk at a time, not its share
    of the model; the spool is also a snapshot, which later passes read rather than the source.
    Whole rank files are never spooled: every FSDP rank file holds a slice of every tensor, so
    that would copy the whole checkpoint to each worker.
    Each tensor is then rewritten in place by the checkpoint's key mapping (`KeyMapping.transform`).
    Tensor data is loaded with torch's weights-only unpickler; `.metadata` as
    `find_dcp_checkpoint` read it.
    """
    store = checkpoint.store
    unknown = [key for key in keys if key not in checkpoint.tensors]
    if unknown:
        raise ExportError(f"no tensor '{unknown[0]}' in DCP checkpoint '{store.uri}'")
    if not keys:
        return SpooledTensors({}, {}, None)
    metadata = read_metadata(store, checkpoint.unsafe_pickle)
    for key in keys:
        expected = checkpoint.tensors[key]
        entry = metadata.state_dict_metadata.get(expected.key)
        if not isinstance(entry, TensorStorageMetadata) or describe_entry(store, expected.key, entry) != expected:
            raise ExportError(f"tensor '{expected.key}' of DCP checkpoint '{store.uri}' changed since it was listed")
    wanted = [checkpoint.tensors[key] for key in keys]
    offsets, size = spool_offsets(wanted)
    path = _new_spool_file(spool_dir, size, store.uri)
    try:
        spool = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        state = {tensor.key: _view(spool, offset, tensor) for tensor, offset in zip(wanted, offsets)}
        finite = {tensor.key: True for tensor in wanted}
        _load_into(store, metadata, state, finite)
        tensors = {key: _transformed(checkpoint.keys, key, state[tensor.key]) for key, tensor in zip(keys, wanted)}
    except BaseException:
        os.remove(path)
        raise
    return SpooledTensors(
        tensors,
        {key: finite[tensor.key] for key, tensor in zip(keys, wanted)},
        path,
    )


def _transformed(keys: KeyMapping, model_key: str, stored: torch.Tensor) -> torch.Tensor:
    """`stored` (a view of the spool) rewritten in place as the model holds it."""
    value = keys.transform(model_key, stored)
    if value is not stored:
        stored.copy_(value)
    release_pages([_page_span(stored)])
    return stored


class SpooledTensors(SourceTensors):
    """A worker's share of a DCP checkpoint: whole tensors by model key, views of one spool file
    mapped into this process (read from disk only when touched), and whether each is finite."""

    def __init__(self, tensors: dict[str, torch.Tensor], finite: dict[str, bool], path: str | None) -> None:
        self.tensors = tensors
        self.finite = finite
        self.path = path  # None when it holds nothing

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def describe(self, advance: Advance = lambda count: None) -> dict[str, ShardInfo]:
        """Every tensor as a plain, whole tensor, with the finiteness found while reading it."""
        infos = {}
        for key, tensor in self.tensors.items():
            infos[key] = ShardInfo(local_shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype), finite=self.finite[key])
            advance(tensor.nbytes)
        return infos

    def mapped_ranges(self) -> list[tuple[int, int]]:
        """The address ranges of the spool file's mapping, for `release_pages`."""
        return mapped_ranges(self.path) if self.path else []


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


def _load_into(store: Store, metadata: Metadata, state: dict[str, torch.Tensor], finite: dict[str, bool]) -> None:
    """Fill `state` (stored keys to views of the spool) with one `load`, chunk by chunk; clear
    `finite[key]` when a chunk of `key` holds NaN or Inf."""

    def landed(key: str, chunk: torch.Tensor) -> None:
        finite[key] = finite[key] and _chunk_is_finite(chunk)
        release_pages([_page_span(state[key])])

    try:
        with warnings.catch_warnings():
            # load() warns that it assumes a single process when no process group exists: intended.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            reader = storage_reader(store, metadata)
            dcp.load(state, storage_reader=reader, planner=_WatchingPlanner(landed), no_dist=True)
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


def _chunk_is_finite(region: torch.Tensor) -> bool:
    """`is_finite` of a region of a tensor, which is strided when the chunk is not whole rows:
    checked a block of rows at a time, so only a block is ever copied."""
    if region.is_contiguous():
        return is_finite(region)
    rows = max(1, CHUNK_ELEMENTS // max(1, region[0].numel()))
    return all(is_finite(block.contiguous()) for block in region.split(rows))


def _page_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses of a contiguous tensor's bytes, widened to whole pages."""
    start = tensor.data_ptr()
    return start - start % mmap.PAGESIZE, start + tensor.nbytes


