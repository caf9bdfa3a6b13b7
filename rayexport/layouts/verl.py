"""verl's FSDP layout: `model_world_size_{W}_rank_{r}.pt` files, `fsdp_config.json`, `huggingface/`."""

from __future__ import annotations

import logging
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rayexport.errors import ExportError
from rayexport.storage import Store

log = logging.getLogger(__name__)

RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
FSDP_CONFIG = "fsdp_config.json"
HF_DIR = "huggingface"
LORA_META = "lora_train_meta.json"


def rank_file_name(world_size: int, rank: int) -> str:
    return f"model_world_size_{world_size}_rank_{rank}.pt"


@dataclass(frozen=True)
class VerlCheckpoint:
    """One verl checkpoint prefix (e.g. `.../global_step_100/actor`)."""

    uri: str
    world_size: int
    fsdp_version: int | None
    rank_files: tuple[str, ...]
    has_hf_config: bool = True
    lora_meta: dict | None = None

    @property
    def layout(self) -> str:
        return f"verl-fsdp{self.fsdp_version}" if self.fsdp_version else "verl-fsdp"


def find_verl_checkpoint(store: Store) -> VerlCheckpoint:
    """Describe the checkpoint at `store`, or raise naming what is missing or inconsistent."""
    if not store.exists():
        raise ExportError(f"source '{store.uri}' does not exist")
    names = store.list()
    if not names and not store.list(HF_DIR):
        raise ExportError(f"source '{store.uri}' is empty")
    fsdp_version = None
    configured_world_size = None
    if FSDP_CONFIG in names:
        fsdp_config = store.read_json(FSDP_CONFIG)
        if not isinstance(fsdp_config, dict):
            raise ExportError(f"'{store.display(FSDP_CONFIG)}' is not a JSON object")
        fsdp_version = fsdp_config.get("FSDP_version")
        configured_world_size = fsdp_config.get("world_size")
    found: dict[int, dict[int, str]] = {}
    for name in names:
        match = RANK_FILE.match(name)
        if match:
            world_size, rank = int(match.group(1)), int(match.group(2))
            found.setdefault(world_size, {})[rank] = name
    if not found:
        raise ExportError(f"no rank files model_world_size_*_rank_*.pt in '{store.uri}'")
    if len(found) > 1:
        sizes = ", ".join(str(size) for size in sorted(found))
        raise ExportError(f"rank files of several world sizes ({sizes}) in '{store.uri}'")
    world_size, ranks = next(iter(found.items()))
    if configured_world_size is not None and configured_world_size != world_size:
        raise ExportError(
            f"'{store.display(FSDP_CONFIG)}' says world_size {configured_world_size} "
            f"but the rank files are for world size {world_size}"
        )
    for rank in range(world_size):
        if rank not in ranks:
            raise ExportError(f"missing rank file '{store.display(rank_file_name(world_size, rank))}'")
    extra = sorted(rank for rank in ranks if rank >= world_size)
    if extra:
        raise ExportError(f"unexpected rank file '{store.display(ranks[extra[0]])}'")
    return VerlCheckpoint(
        uri=store.uri,
        world_size=world_size,
        fsdp_version=fsdp_version,
        rank_files=tuple(ranks[rank] for rank in range(world_size)),
        has_hf_config="config.json" in store.list(HF_DIR),
        lora_meta=store.read_json(LORA_META) if LORA_META in names else None,
    )


def load_rank_state(
    store: Store, name: str, spool_dir: str, unsafe_pickle: bool = False, progress: Callable[[int], Any] = lambda count: None
) -> tuple[dict[str, torch.Tensor], str]:
    """Load one rank file memory-mapped, with the weights-only unpickler (tensors, DTensors and
    their placements only) unless `unsafe_pickle`, which runs arbitrary pickled code. Returns
    the state and the local file it maps.

    A remote file is spooled to local disk first so that it too is memory-mapped rather than
    held in RAM; `progress` gets each count of bytes spooled.
    """
    import torch.distributed.tensor  # noqa: F401 - registers DTensor for weights_only loading

    if store.is_local:
        path = store.path(name)
        if not os.path.exists(path):
            raise ExportError(f"not found: '{store.display(name)}'")
    else:
        path = os.path.join(spool_dir, name)
        store.download(name, path, progress)
    try:
        state = torch.load(path, map_location="cpu", weights_only=not unsafe_pickle, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ExportError(f"rank file '{store.display(name)}' cannot be loaded: {reason}") from None
    if not isinstance(state, dict) or not all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in state.items()
    ):
        raise ExportError(f"rank file '{store.display(name)}' is not a model state dict")
    return state, path
