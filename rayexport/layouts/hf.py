"""A Hugging Face model folder as a source of base weights (for LoRA-only checkpoints)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Iterator

import torch
from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE

from rayexport.dtypes import TORCH_NAME_OF_CODE
from rayexport.errors import ExportError, one_line
from rayexport.layouts.shards import ShardInfo
from rayexport.storage import Store



def weight_files(store: Store) -> list[str]:
    """The safetensors files of an HF folder, from its index when it has one."""
    names = store.list()
    if SAFETENSORS_INDEX_FILE in names:
        weight_map = store.read_json(SAFETENSORS_INDEX_FILE).get("weight_map", {})
        return sorted(set(weight_map.values()))
    if SAFETENSORS_SINGLE_FILE in names:
        return [SAFETENSORS_SINGLE_FILE]
    raise ExportError(f"base model '{store.uri}' has no {SAFETENSORS_SINGLE_FILE} or {SAFETENSORS_INDEX_FILE}")


class SafetensorsTensors(Mapping):
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

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.handles[self.file_of[key]].get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)

    def describe(self) -> dict[str, ShardInfo]:
        """Every tensor as a plain, whole tensor."""
        infos = {}
        for key, name in self.file_of.items():
            sliced = self.handles[name].get_slice(key)
            dtype = TORCH_NAME_OF_CODE[sliced.get_dtype()]
            infos[key] = ShardInfo(local_shape=tuple(sliced.get_shape()), dtype=dtype)
        return infos

