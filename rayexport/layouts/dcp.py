"""PyTorch Distributed Checkpoint (DCP) layout: `__{rank}_{n}.distcp` files plus `.metadata`, as
FSDP2 training loops, torchtitan, accelerate and `torch.distributed.checkpoint.save` write them.

Everything goes through torch's own DCP machinery: its storage reader parses `.metadata` (every
key's global shape, dtype and chunks), and `torch.distributed.checkpoint.load` without a process
group fills whole tensors from whichever chunks of whichever rank files hold them. A remote
checkpoint is read in place with torch's fsspec reader, which fetches only the byte ranges of the
requested chunks.
"""

from __future__ import annotations

import heapq
import math
import os
import warnings
from dataclasses import dataclass

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from rayexport.dtypes import dtype_name
from rayexport.errors import ExportError
from rayexport.storage import Store

DCP_METADATA = ".metadata"

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


def is_dcp_checkpoint(store: Store) -> bool:
    """Whether `store` holds a DCP checkpoint, i.e. a `.metadata` file directly under it."""
    return store.exists(DCP_METADATA)


def find_dcp_checkpoint(store: Store, prefix: str | None = None) -> DcpCheckpoint:
    """Describe the model tensors of the DCP checkpoint at `store` from its `.metadata`.

    `prefix` is the part of the stored keys to strip to get model keys ("model.", "app.model.",
    "" ...); by default it is detected from how the state dict was nested when saved. Optimizer,
    scheduler and other training state, and every non-tensor entry, go to `skipped`. Raises
    ExportError when `.metadata` is missing or unreadable, or no model tensor is found.
    """
    metadata = _read_metadata(store)
    entries = metadata.state_dict_metadata
    tensor_keys = [key for key, value in entries.items() if isinstance(value, TensorStorageMetadata)]
    if not tensor_keys:
        raise ExportError(f"DCP checkpoint '{store.uri}' holds no tensors")
    if prefix is None:
        prefix = _detect_prefix(tensor_keys, metadata.planner_data, store.uri)
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
    return DcpCheckpoint(uri=store.uri, prefix=prefix, tensors=tensors, skipped=sorted(skipped))


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


def read_tensors(store: Store, checkpoint: DcpCheckpoint, keys: list[str], spool_dir: str) -> dict[str, torch.Tensor]:
    """Read the whole tensors `keys` (model keys) in this process, keyed by model key.

    `torch.distributed.checkpoint.load` runs without a process group and reads only the chunks
    of these tensors, from local files or, for a remote store, by byte ranges through torch's
    fsspec reader, so nothing is spooled and `spool_dir` stays unused.
    """
    del spool_dir  # ranged reads make spooling whole rank files (each holding a slice of every tensor) needless
    unknown = [key for key in keys if key not in checkpoint.tensors]
    if unknown:
        raise ExportError(f"no tensor '{unknown[0]}' in DCP checkpoint '{store.uri}'")
    if not keys:
        return {}
    metadata = _read_metadata(store)
    state: dict[str, torch.Tensor] = {}
    for key in keys:
        expected = checkpoint.tensors[key]
        entry = metadata.state_dict_metadata.get(expected.key)
        if not isinstance(entry, TensorStorageMetadata) or _describe(store, expected.key, entry) != expected:
            raise ExportError(f"tensor '{expected.key}' of DCP checkpoint '{store.uri}' changed since it was listed")
        state[expected.key] = torch.empty(expected.shape, dtype=getattr(torch, expected.dtype))
    try:
        with warnings.catch_warnings():
            # load() warns that it assumes a single process when no process group exists: intended.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=_reader(store, metadata), planner=DefaultLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - torch and storage clients raise many types
        error = _unwrap(error)
        if isinstance(error, FileNotFoundError):
            missing = os.path.basename(str(error.filename or error.args[-1]))
            raise ExportError(f"DCP checkpoint '{store.uri}' is missing '{missing}'") from None
        raise ExportError(f"cannot read DCP checkpoint '{store.uri}': {_reason(error)}") from None
    return {key: state[checkpoint.tensors[key].key] for key in keys}


def _reader(store: Store, metadata: Metadata | None = None):
    """torch's storage reader for `store`: plain files when local, fsspec otherwise.

    Given `metadata`, the reader hands it to `load` instead of fetching `.metadata` again.
    """
    if store.is_local:
        reader = _KnownMetadataFileReader(store.path())
    else:
        protocol = fsspec.core.split_protocol(store.uri)[0]
        # The same options the Store opened its filesystem with, so fsspec reuses that instance.
        options = store.options if protocol in ("s3", "s3a") else {}
        reader = _KnownMetadataFsspecReader(store.uri, **options)
    reader.known_metadata = metadata
    return reader


class _KnownMetadata:
    known_metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self.known_metadata is not None:
            return self.known_metadata
        return super().read_metadata(*args, **kwargs)


class _KnownMetadataFileReader(_KnownMetadata, FileSystemReader):
    pass


class _KnownMetadataFsspecReader(_KnownMetadata, FsspecReader):
    pass


def _read_metadata(store: Store) -> Metadata:
    where = store.display(DCP_METADATA)
    try:
        metadata = _reader(store).read_metadata()
    except FileNotFoundError:
        raise ExportError(f"no DCP metadata file '{where}'") from None
    except Exception as error:  # noqa: BLE001 - unpickling a damaged file raises many types
        raise ExportError(f"DCP metadata '{where}' cannot be read: {_reason(error)}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ExportError(f"'{where}' is not DCP metadata")
    return metadata


def _describe(store: Store, key: str, entry: TensorStorageMetadata) -> DcpTensor:
    shape = tuple(int(size) for size in entry.size)
    numel = math.prod(shape)
    # load() leaves any part of a tensor that no chunk covers uninitialised, so check coverage
    # here; DCP de-duplicates replicated chunks, so chunk volumes add up to the tensor's.
    covered = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
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
    paths = []
    for key in tensor_keys:
        path = planner_data.get(key) if isinstance(planner_data, dict) else None
        if path is None or ".".join(map(str, path)) != key:
            path = _guess_path(key, tensor_keys)
        if not any(str(part).split(".")[0] in NON_MODEL_NAMES for part in path[:-1]) and (
            len(path) > 1 or _first_name(key) not in NON_MODEL_NAMES
        ):
            paths.append(tuple(str(part) for part in path))
    if not paths:
        raise ExportError(f"DCP checkpoint '{uri}' holds no model tensors, only training state")
    for prefix in MODEL_PREFIXES:
        container = tuple(prefix.split(".")[:-1])
        if prefix == "" and any(len(path) == 1 for path in paths):
            return prefix
        if prefix and any(len(path) > len(container) and path[: len(container)] == container for path in paths):
            return prefix
    roots = sorted({path[0] for path in paths if len(path) > 1})
    if len(roots) == 1:
        return roots[0] + "."
    found = ", ".join(f"'{root}.'" for root in roots) or "none"
    raise ExportError(f"cannot tell which state dict is the model in DCP checkpoint '{uri}' (prefixes: {found})")


def _guess_path(key: str, all_keys: list[str]) -> tuple[str, ...]:
    """A key's original nesting when `planner_data` does not record it."""
    for prefix in ("app.model.", "state_dict."):
        if key.startswith(prefix):
            return (*prefix.split(".")[:-1], key[len(prefix):])
    if _first_name(key) in NON_MODEL_NAMES:
        return (_first_name(key), key.split(".", 1)[-1])
    model_keys = [other for other in all_keys if _first_name(other) not in NON_MODEL_NAMES]
    # Flat Hugging Face keys often all start with "model." too; only a doubled "model.model."
    # (or a bare "model.lm_head.") shows a nested {"model": state_dict}.
    if all(other.startswith("model.") for other in model_keys) and any(
        other.startswith(("model.model.", "model.lm_head.")) for other in model_keys
    ):
        return ("model", key[len("model."):])
    return (key,)


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
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
