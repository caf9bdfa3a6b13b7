"""A Hugging Face model folder as a source of base weights (for LoRA-only checkpoints): the
exporter (worker 0) reads them as the pseudo-rank BASE_MODEL_RANK."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE

from rayexport.common.dtypes import TORCH_NAME_OF_CODE, nbytes
from rayexport.common.errors import ExportError, one_line
from rayexport.layouts.base import Advance, Checkpoint, Loaded, LoadStep, SourceTensors
from rayexport.plan.pieces import BASE_MODEL_RANK
from rayexport.plan.shards import ShardInfo
from rayexport.storage.store import Store

if TYPE_CHECKING:
    import torch


def weight_files(store: Store) -> list[str]:
    """The safetensors files of an HF folder, from its index when it has one."""
    names = store.list()
    if SAFETENSORS_INDEX_FILE in names:
        weight_map = store.read_json(SAFETENSORS_INDEX_FILE).get("weight_map", {})
        return sorted(set(weight_map.values()))
    if SAFETENSORS_SINGLE_FILE in names:
        return [SAFETENSORS_SINGLE_FILE]
    raise ExportError(f"base model '{store.uri}' has no {SAFETENSORS_SINGLE_FILE} or {SAFETENSORS_INDEX_FILE}")


@dataclass(frozen=True)
class BaseModelFolder(Checkpoint):
    """A base model's folder (`--base-model`), whole tensors in safetensors files."""

    def read_files(self) -> dict[str, int]:
        """The weight files, with their sizes."""
        return {name: self.store.size(name) for name in weight_files(self.store)}

    def share(
        self, num_workers: int, aliases: dict[str, str], load: LoadStep, file_readers: dict[str, int] | None = None
    ) -> Loaded:
        """The exporter reads every tensor."""
        rank_infos = load({0: None})
        holders = {key: {BASE_MODEL_RANK: info} for key, info in rank_infos[BASE_MODEL_RANK].items()}
        return Loaded(rank_infos, holders, {BASE_MODEL_RANK: 0})

    def part_bytes(self, part: None) -> int:
        """The bytes of the folder's weight files."""
        return sum(self.read_files().values())

    def read(self, part: None, spool_dir: str, spooled: Advance) -> dict[int, SourceTensors]:
        """The folder's tensors, memory-mapped (remote files spooled first)."""
        return {BASE_MODEL_RANK: SafetensorsTensors(self.store, spool_dir)}


def base_model_folder(store: Store) -> BaseModelFolder:
    """The base model folder at `store` as a source of weights."""
    return BaseModelFolder(store=store, world_size=1, layout="hf")


class SafetensorsFiles(SourceTensors):
    """Tensors by key from memory-mapped safetensors files: `handles` (file -> safe_open
    handle) and `file_of` (key -> file), filled by a subclass; read only when asked for."""

    handles: dict
    file_of: dict[str, str]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.handles[self.file_of[key]].get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)


class SafetensorsTensors(SafetensorsFiles):
    """The tensors of an HF folder by name, memory-mapped, read only when asked for."""

    def __init__(self, store: Store, spool_dir: str) -> None:
        from safetensors import safe_open

        self.handles = {}
        self.file_of: dict[str, str] = {}
        for name in weight_files(store):
            path = store.path(name) if store.is_local else os.path.join(spool_dir, f"base-{name}")
            if not store.is_local:
                store.download(name, path)
            try:
                handle = safe_open(path, framework="pt")
            except Exception as error:  # noqa: BLE001 - safetensors raises its own types
                raise ExportError(f"base model file '{store.display(name)}' cannot be read: {one_line(error)}") from None
            self.handles[name] = handle
            for key in handle.keys():
                self.file_of[key] = name

    def describe(self, advance: Advance = lambda count: None) -> dict[str, ShardInfo]:
        """Every tensor as a plain, whole tensor, from the files' headers."""
        infos = {}
        for key, name in self.file_of.items():
            sliced = self.handles[name].get_slice(key)
            dtype = TORCH_NAME_OF_CODE[sliced.get_dtype()]
            infos[key] = ShardInfo(local_shape=tuple(sliced.get_shape()), dtype=dtype)
            advance(nbytes(infos[key].local_shape, dtype))
        return infos

