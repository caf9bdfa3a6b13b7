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

import heapq
import io
import math
import mmap
import os
import pickle
import re
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterator

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from rayexport.dtypes import dtype_name, dtype_of
from rayexport.errors import ExportError, one_line
from rayexport.layouts.mapped import mapped_ranges, release_pages
from rayexport.layouts.shards import ShardInfo
from rayexport.scan import CHUNK_ELEMENTS, is_finite
from rayexport.storage import Store

DCP_METADATA = ".metadata"
# Where tensors start in a worker's spool file: a multiple of every dtype's size.
SPOOL_ALIGNMENT = 64
_DISTCP_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")

# accelerate's `save_state` (and transformers' Trainer and TRL under FSDP's sharded state dict)
# writes each model as DCP in a folder of its own, beside `optimizer_<i>/`.
ACCELERATE_MODEL_FOLDER = re.compile(r"^pytorch_model_fsdp_\d+$")

# Top-level names of the non-model state that training loops save beside the model.
NON_MODEL_NAMES = frozenset({
    "optim", "optimizer", "optimizers", "optim_state", "optimizer_state", "optimizer_states",
    "lr_scheduler", "lr_schedulers", "scheduler", "schedulers", "dataloader", "dataloaders",
    "train_state", "trainer_state", "rng", "rng_state", "rng_states", "grad_scaler", "scaler",
})
# Where model state dicts are usually nested, most specific first; "" is a flat model state dict.
MODEL_PREFIXES = ("model.", "app.model.", "state_dict.", "")


@dataclass(frozen=True)
class DcpTensor:
    """One model tensor of a DCP checkpoint, as its metadata describes it."""

    key: str  # as stored, prefix included
    shape: tuple[int, ...]  # global shape
    dtype: str  # torch dtype name without "torch."
    nbytes: int


@dataclass(frozen=True)
class DcpCheckpoint:
    """The model tensors of one DCP checkpoint directory."""

    uri: str
    prefix: str  # stripped from stored keys to give model keys
    tensors: dict[str, DcpTensor]  # by model key
    skipped: list[str]  # stored keys that are not model tensors
    world_size: int = 0  # ranks that saved it (from the .distcp file names)
    has_hf_config: bool = False  # a huggingface/config.json beside it
    lora_meta: dict | None = None
    layout: str = "dcp"


def is_dcp_checkpoint(store: Store) -> bool:
    """Whether `store` holds a DCP checkpoint, i.e. a `.metadata` file directly under it."""
    return store.exists(DCP_METADATA)


def find_dcp_checkpoint(store: Store, prefix: str | None = None, *, unsafe_pickle: bool = False) -> DcpCheckpoint:
    """Describe the model tensors of the DCP checkpoint at `store` from its `.metadata`.

    `prefix` is the part of the stored keys to strip to get model keys ("model.", "app.model.",
    "" ...; a missing final "." is added); by default it is detected from how the state dict was nested when saved. Optimizer,
    scheduler and other training state, and every non-tensor entry, go to `skipped`. Raises
    ExportError when `.metadata` is missing or unreadable, or no model tensor is found.

    `.metadata` is a pickle: it is unpickled allowing only the classes DCP metadata is made of,
    unless `unsafe_pickle`, which unpickles it as torch does, running any code it holds.
    """
    metadata = _read_metadata(store, unsafe_pickle)
    entries = metadata.state_dict_metadata
    tensor_keys = [key for key, value in entries.items() if isinstance(value, TensorStorageMetadata)]
    if not tensor_keys:
        raise ExportError(f"DCP checkpoint '{store.uri}' holds no tensors")
    if prefix is None:
        prefix = _detect_prefix(tensor_keys, metadata.planner_data, store.uri)
    elif prefix and not prefix.endswith("."):
        prefix += "."
    tensors: dict[str, DcpTensor] = {}
    skipped = [key for key, value in entries.items() if not isinstance(value, TensorStorageMetadata)]
    for key in tensor_keys:
        model_key = key[len(prefix):] if key.startswith(prefix) else None
        if not model_key or _first_name(model_key) in NON_MODEL_NAMES:
            skipped.append(key)
            continue
        tensors[model_key] = _describe(store, key, entries[key])
    if not tensors:
        raise ExportError(f"no model tensors under key prefix '{prefix}' in DCP checkpoint '{store.uri}'")
    names = store.list()
    ranks = {match.group(1) for match in map(_DISTCP_FILE.match, names) if match}
    return DcpCheckpoint(
        uri=store.uri, prefix=prefix, tensors=tensors, skipped=sorted(skipped), world_size=len(ranks),
        has_hf_config="config.json" in store.list("huggingface"),
    )


def accelerate_model_folder(store: Store) -> str | None:
    """The model folder of an accelerate checkpoint at `store`: its one `pytorch_model_fsdp_<i>/`,
    None where it holds none. Several (one per model) are refused, naming them."""
    found = [name for name in store.folders() if ACCELERATE_MODEL_FOLDER.match(name)]
    if len(found) > 1:
        raise ExportError(
            f"'{store.uri}' holds {len(found)} model checkpoints ({', '.join(found)}); pass the one to export as --src"
        )
    return found[0] if found else None


def assign_tensors(checkpoint: DcpCheckpoint, num_workers: int) -> list[list[str]]:
    """Split the model keys over `num_workers` workers with about equal bytes each.

    Greedy largest-first onto the least loaded worker, ties broken by key and worker index, so
    the same checkpoint always gets the same assignment. Each worker's keys are sorted.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, not {num_workers}")
    loads = [(0, worker) for worker in range(num_workers)]
    assigned: list[list[str]] = [[] for _ in range(num_workers)]
    for key, tensor in sorted(checkpoint.tensors.items(), key=lambda item: (-item[1].nbytes, item[0])):
        load, worker = heapq.heappop(loads)
        assigned[worker].append(key)
        heapq.heappush(loads, (load + tensor.nbytes, worker))
    return [sorted(keys) for keys in assigned]


def read_tensors(
    store: Store, checkpoint: DcpCheckpoint, keys: list[str], spool_dir: str, *, unsafe_pickle: bool = False
) -> SpooledTensors:
    """Read the whole tensors `keys` (model keys) into one local file in `spool_dir`, memory-mapped;
    return them keyed by model key, with whether each is finite.

    `torch.distributed.checkpoint.load` runs without a process group and reads only the chunks
    of these tensors, from local files or, for a remote store, with one ranged request each.
    Each chunk is copied straight into its place in the mapped spool file, checked for NaN and
    Inf, and its pages given back, so this process holds about one chunk at a time, not its share
    of the model; the spool is also a snapshot, which later passes read rather than the source.
    Whole rank files are never spooled: every FSDP rank file holds a slice of every tensor, so
    that would copy the whole checkpoint to each worker.
    Tensor data is loaded with torch's weights-only unpickler; `unsafe_pickle` is
    `find_dcp_checkpoint`'s, for `.metadata`.
    """
    unknown = [key for key in keys if key not in checkpoint.tensors]
    if unknown:
        raise ExportError(f"no tensor '{unknown[0]}' in DCP checkpoint '{store.uri}'")
    if not keys:
        return SpooledTensors({}, {}, None)
    metadata = _read_metadata(store, unsafe_pickle)
    for key in keys:
        expected = checkpoint.tensors[key]
        entry = metadata.state_dict_metadata.get(expected.key)
        if not isinstance(entry, TensorStorageMetadata) or _describe(store, expected.key, entry) != expected:
            raise ExportError(f"tensor '{expected.key}' of DCP checkpoint '{store.uri}' changed since it was listed")
    wanted = [checkpoint.tensors[key] for key in keys]
    offsets, size = spool_offsets(wanted)
    path = _new_spool_file(spool_dir, size, store.uri)
    try:
        spool = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        state = {tensor.key: _view(spool, offset, tensor) for tensor, offset in zip(wanted, offsets)}
        finite = {tensor.key: True for tensor in wanted}
        _load_into(store, metadata, state, finite)
    except BaseException:
        os.remove(path)
        raise
    return SpooledTensors(
        {key: state[tensor.key] for key, tensor in zip(keys, wanted)},
        {key: finite[tensor.key] for key, tensor in zip(keys, wanted)},
        path,
    )


class SpooledTensors(Mapping):
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

    def describe(self) -> dict[str, ShardInfo]:
        """Every tensor as a plain, whole tensor, with the finiteness found while reading it."""
        return {
            key: ShardInfo(local_shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype), finite=self.finite[key])
            for key, tensor in self.tensors.items()
        }

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
            f"cannot make a {size}-byte spool file in '{spool_dir}' for DCP checkpoint '{uri}': {_reason(error)}"
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
            reader = _reader(store, metadata)
            dcp.load(state, storage_reader=reader, planner=_WatchingPlanner(landed), no_dist=True)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - torch and storage clients raise many types
        error = _unwrap(error)
        if isinstance(error, FileNotFoundError):
            missing = os.path.basename(str(error.filename or error.args[-1]))
            raise ExportError(f"DCP checkpoint '{store.uri}' is missing '{missing}'") from None
        raise ExportError(f"cannot read DCP checkpoint '{store.uri}': {_reason(error)}") from None


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


def _reader(store: Store, metadata: Metadata | None = None, unsafe_pickle: bool = False):
    """torch's storage reader for `store`: plain files when local, fsspec otherwise.

    Given `metadata`, the reader hands it to `load` instead of fetching `.metadata` again.
    """
    if store.is_local:
        reader = _CheckedFileSystemReader(store.path())
    else:
        protocol = fsspec.core.split_protocol(store.uri)[0]
        # The same options the Store opened its filesystem with, so fsspec reuses that instance.
        options = store.options if protocol in ("s3", "s3a") else {}
        reader = _CheckedFsspecReader(store.uri, **options)
    reader.known_metadata = metadata
    reader.unsafe_pickle = unsafe_pickle
    return reader


class _CheckedMetadataReading:
    """torch's reader, but `.metadata` is read once and unpickled with an allow-list: torch's
    own `read_metadata` is a bare `pickle.load`, which runs whatever code the file holds."""

    known_metadata: Metadata | None = None
    unsafe_pickle: bool = False

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self.known_metadata is not None:
            return self.known_metadata
        if self.unsafe_pickle:
            return super().read_metadata(*args, **kwargs)
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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


class _RefusedGlobal(Exception):
    pass


# Everything a `.metadata` written by torch's save planners refers to by name.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # where TensorProperties lived in checkpoints from older torch
    "torch.distributed._shard.sharded_tensor.metadata": {"TensorProperties", "MEM_FORMAT_ENCODING"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
# storage_meta.checkpoint_id is the writer's Path; a concrete Path of the other OS cannot be
# created here, and only its text matters.
_PURE_PATHS = {"Path": "PurePath", "PosixPath": "PurePosixPath", "WindowsPath": "PureWindowsPath"}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "pathlib" and name in _PURE_PATHS:
            name = _PURE_PATHS[name]
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _RefusedGlobal(f"{module}.{name}")


def _read_metadata(store: Store, unsafe_pickle: bool = False) -> Metadata:
    where = store.display(DCP_METADATA)
    try:
        metadata = _reader(store, unsafe_pickle=unsafe_pickle).read_metadata()
    except FileNotFoundError:
        raise ExportError(f"no DCP metadata file '{where}'") from None
    except _RefusedGlobal as refused:
        raise ExportError(
            f"DCP metadata '{where}' refers to '{refused}', which DCP metadata never needs; "
            "refusing to unpickle it (unsafe pickle loading runs such code: only for trusted checkpoints)"
        ) from None
    except Exception as error:  # noqa: BLE001 - unpickling a damaged file raises many types
        raise ExportError(f"DCP metadata '{where}' cannot be read: {_reason(error)}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ExportError(f"'{where}' is not DCP metadata")
    return metadata


def _describe(store: Store, key: str, entry: TensorStorageMetadata) -> DcpTensor:
    shape = tuple(int(size) for size in entry.size)
    numel = math.prod(shape)
    # load() leaves any part of a tensor that no chunk covers uninitialised, so check coverage
    # here. Saved chunks do not overlap (replicas of one shard share offsets and are stored once),
    # so the volumes of the distinct chunks add up to the tensor's.
    distinct = {(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in entry.chunks}
    covered = sum(math.prod(sizes) for _, sizes in distinct)
    if covered != numel:
        raise ExportError(
            f"chunks of '{key}' in DCP checkpoint '{store.uri}' cover {covered} of {numel} elements"
        )
    dtype = entry.properties.dtype
    return DcpTensor(key=key, shape=shape, dtype=dtype_name(dtype), nbytes=numel * dtype.itemsize)


def _detect_prefix(tensor_keys: list[str], planner_data, uri: str) -> str:
    """The model prefix of a checkpoint's tensor keys.

    DCP flattens nested state dicts by joining keys with ".", so "model." + "model.norm.weight"
    and a flat "model.norm.weight" cannot be told apart from the keys; the default save planner
    records each key's original path in `planner_data`, which settles it. Without it, the keys
    alone decide.
    """
    recorded = planner_data if isinstance(planner_data, dict) else {}
    guessed = None
    paths = []
    for key in tensor_keys:
        path = recorded.get(key)
        if path is None or ".".join(map(str, path)) != key:
            guessed = guessed or _guess_paths(tensor_keys)
            path = guessed[key]
        path = tuple(str(part) for part in path)
        containers = path[:-1] if len(path) > 1 else (_first_name(key),)
        if not any(_first_name(part) in NON_MODEL_NAMES for part in containers):
            paths.append(path)
    if not paths:
        raise ExportError(f"DCP checkpoint '{uri}' holds no model tensors, only training state")
    for prefix in MODEL_PREFIXES:
        container = tuple(prefix.split(".")[:-1])
        if container and any(len(path) > len(container) and path[: len(container)] == container for path in paths):
            return prefix
        if not container and any(len(path) == 1 for path in paths):
            return prefix
    roots = sorted({path[0] for path in paths if len(path) > 1})
    if len(roots) == 1:
        return roots[0] + "."
    found = ", ".join(f"'{root}.'" for root in roots)
    raise ExportError(f"cannot tell which state dict is the model in DCP checkpoint '{uri}' (prefixes: {found})")


def _guess_paths(keys: list[str]) -> dict[str, tuple[str, ...]]:
    """Each key's original nesting, guessed from the keys alone (no `planner_data`)."""
    model_keys = [key for key in keys if _first_name(key) not in NON_MODEL_NAMES]
    # Flat Hugging Face keys often all start with "model." too; only a doubled "model.model."
    # (or "model.lm_head.") shows a nested {"model": state_dict}.
    nested_model = all(key.startswith("model.") for key in model_keys) and any(
        key.startswith(("model.model.", "model.lm_head.")) for key in model_keys
    )
    paths = {}
    for key in keys:
        for prefix in ("app.model.", "state_dict.") + (("model.",) if nested_model else ()):
            if key.startswith(prefix):
                paths[key] = (*prefix.split(".")[:-1], key[len(prefix):])
                break
        else:
            first, _, rest = key.partition(".")
            paths[key] = (first, rest) if first in NON_MODEL_NAMES and rest else (key,)
    return paths


def _unwrap(error: BaseException) -> BaseException:
    """The first rank's own exception from a CheckpointException, which load() raises, even
    without a process group, for any failure while planning or reading (and which derives from
    BaseException, not Exception)."""
    if isinstance(error, CheckpointException) and error.failures:
        wrapped = next(iter(error.failures.values()))
        return wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return error


def _first_name(key: str) -> str:
    return key.split(".", 1)[0]


def _reason(error: BaseException) -> str:
    text = one_line(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
