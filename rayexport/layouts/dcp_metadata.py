"""A DCP checkpoint's `.metadata`, read safely: unpickled from an allow-list, each stored
tensor's description, and which stored keys are the model's."""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rayexport.common.dtypes import dtype_name
from rayexport.common.errors import ExportError, one_line
from rayexport.storage.store import Store

# torch.distributed.checkpoint is imported only where a DCP checkpoint is read: with the DTensor it
# brings, 0.4 s of every process's start, in the exports of other layouts too.
if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

DCP_METADATA = ".metadata"

# Top-level names of the non-model state that training loops save beside the model.
NON_MODEL_NAMES = frozenset({
    "optim", "optimizer", "optimizers", "optim_state", "optimizer_state", "optimizer_states",
    "lr_scheduler", "lr_schedulers", "scheduler", "schedulers", "dataloader", "dataloaders",
    "train_state", "trainer_state", "rng", "rng_state", "rng_states", "grad_scaler", "scaler",
})
# Where model state dicts are usually nested, most specific first; "" is a flat model state dict.
# "app.model.": torch's DCP recipe's {"app": AppState}, as OpenRLHF's FSDP2 backend and prime-rl
# save; "dcp.model.": AReaL's {"dcp": DCPState}.
MODEL_PREFIXES = ("model.", "app.model.", "dcp.model.", "state_dict.", "")


@dataclass(frozen=True)
class DcpTensor:
    """One model tensor of a DCP checkpoint, as its metadata describes it."""

    key: str  # as stored, prefix included
    shape: tuple[int, ...]  # global shape
    dtype: str  # torch dtype name without "torch."
    nbytes: int


class _RefusedGlobal(Exception):
    pass


# Everything a `.metadata` written by torch's save planners refers to by name.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Megatron-Core's torch_dist save keeps every rank's plan in `all_local_plans`
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"},
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
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _RefusedGlobal(f"{module}.{name}")


# Each `.metadata` as this process last read it, by URI, with the version it was read at
# (`Store.version`): the layouts' detect and describe, and the watcher's passes, read a file that
# has not changed once.
_READ: dict[str, tuple[tuple, bytes]] = {}
_READ_LIMIT = 4


def _metadata_bytes(store: Store) -> bytes:
    """The bytes of the checkpoint's `.metadata`, from this process's last read while unchanged."""
    where = store.display(DCP_METADATA)
    try:
        version = store.version(DCP_METADATA)
    except ExportError:
        if not store.exists(DCP_METADATA):
            raise ExportError(f"no DCP metadata file '{where}'") from None
        raise
    cached = _READ.get(where)
    if cached is not None and cached[0] == version:
        return cached[1]
    data = store.read_bytes(DCP_METADATA)
    _READ.pop(where, None)
    if len(_READ) >= _READ_LIMIT:
        _READ.pop(next(iter(_READ)))
    _READ[where] = version, data
    return data


def read_metadata(store: Store, unsafe_pickle: bool = False) -> Metadata:
    """The checkpoint's `.metadata`, read through `store` (so from whichever node holds it) and
    unpickled allowing only the classes DCP metadata is made of, unless `unsafe_pickle`."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    where = store.display(DCP_METADATA)
    data = _metadata_bytes(store)
    try:
        metadata = pickle.loads(data) if unsafe_pickle else _MetadataUnpickler(io.BytesIO(data)).load()
    except _RefusedGlobal as refused:
        raise ExportError(
            f"DCP metadata '{where}' refers to '{refused}', which DCP metadata never needs; "
            "refusing to unpickle it (unsafe pickle loading runs such code: only for trusted checkpoints)"
        ) from None
    except Exception as error:  # noqa: BLE001 - unpickling a damaged file raises many types
        raise ExportError(f"DCP metadata '{where}' cannot be read: {reason(error)}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ExportError(f"'{where}' is not DCP metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def describe_entry(store: Store, key: str, entry: TensorStorageMetadata) -> DcpTensor:
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


def detect_prefix(tensor_keys: list[str], planner_data, uri: str) -> str:
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
        containers = path[:-1] if len(path) > 1 else (first_name(key),)
        if not any(first_name(part) in NON_MODEL_NAMES for part in containers):
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
    model_keys = [key for key in keys if first_name(key) not in NON_MODEL_NAMES]
    # Flat Hugging Face keys often all start with "model." too; only a doubled "model.model."
    # (or "model.lm_head.") shows a nested {"model": state_dict}.
    nested_model = all(key.startswith("model.") for key in model_keys) and any(
        key.startswith(("model.model.", "model.lm_head.")) for key in model_keys
    )
    nested = [prefix for prefix in MODEL_PREFIXES if prefix and (prefix != "model." or nested_model)]
    paths = {}
    for key in keys:
        for prefix in nested:
            if key.startswith(prefix):
                paths[key] = (*prefix.split(".")[:-1], key[len(prefix):])
                break
        else:
            first, _, rest = key.partition(".")
            paths[key] = (first, rest) if first in NON_MODEL_NAMES and rest else (key,)
    return paths


def first_name(key: str) -> str:
    return key.split(".", 1)[0]


def reason(error: BaseException) -> str:
    text = one_line(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
