"""The model a checkpoint belongs to, from its Hugging Face folder: config, class, and the
names, shapes and ties of its tensors, learnt on the meta device (no weights, no hub)."""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from typing import Any

import torch

from rayexport.dtypes import dtype_name
from rayexport.errors import ExportError, one_line
from rayexport.storage import Store

WEIGHT_FILE = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.ckpt|\.safetensors\.index\.json|\.bin\.index\.json)$")


def hf_file_names(hf_store: Store) -> list[str]:
    """The files of a Hugging Face folder worth carrying into an export: everything but weights."""
    root = hf_store.path()
    try:
        found = hf_store.fs.find(root)
    except Exception as error:  # noqa: BLE001 - storage clients raise many types
        raise ExportError(f"cannot list '{hf_store.uri}': {error}") from None
    names = sorted(posixpath.relpath(path, root) for path in found)
    return [name for name in names if not WEIGHT_FILE.search(name)]


def fetch_hf_folder(hf_store: Store, local_dir: str) -> list[str]:
    """Copy the non-weight files of a Hugging Face folder to `local_dir`; return their names."""
    names = hf_file_names(hf_store)
    for name in names:
        target = os.path.join(local_dir, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as handle:
            handle.write(hf_store.read_bytes(name))
    return names


def load_config(local_dir: str, raw: dict, trust_remote_code: bool):
    """The model's `PretrainedConfig` from a local HF folder whose config.json parsed to `raw`,
    with one clear line for any problem."""
    from transformers import AutoConfig

    if raw.get("auto_map") and not trust_remote_code:
        raise ExportError(
            "config.json has auto_map (remote code); pass --trust-remote-code to build it"
        )
    try:
        return AutoConfig.from_pretrained(local_dir, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - transformers raises many types
        raise ExportError(f"config.json cannot be loaded by transformers: {one_line(error)}") from None


def config_dtype(config) -> str | None:
    """The dtype the config declares (`dtype`, formerly `torch_dtype`), as a torch name."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if value is None:
        return None
    return dtype_name(value) if not isinstance(value, str) else value.removeprefix("torch.")


@dataclass(frozen=True)
class ModelClass:
    """How to build this config's model: an architecture class, or an Auto class for remote code."""

    class_name: str
    auto_class: bool

    def resolve(self):
        import transformers

        return getattr(transformers, self.class_name)

    def build(self, config, trust_remote_code: bool) -> torch.nn.Module:
        cls = self.resolve()
        if self.auto_class:
            return cls.from_config(config, trust_remote_code=trust_remote_code)
        return cls._from_config(config)

    def load(self, path: str, trust_remote_code: bool, **kwargs: Any) -> torch.nn.Module:
        kwargs = dict(kwargs, trust_remote_code=trust_remote_code) if self.auto_class else kwargs
        return self.resolve().from_pretrained(path, **kwargs)


def model_class(config) -> ModelClass:
    """The class named by `architectures`, or for remote code the Auto class that maps to it."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    architecture = architectures[0] if architectures else None
    auto_map = getattr(config, "auto_map", None) or {}
    for auto_name, reference in auto_map.items():
        if (
            auto_name.startswith("AutoModel")
            and isinstance(reference, str)
            and reference.rsplit(".", 1)[-1] == architecture
        ):
            return ModelClass(auto_name, auto_class=True)
    if architecture and hasattr(transformers, architecture):
        return ModelClass(architecture, auto_class=False)
    if architecture is None:
        raise ExportError("config.json names no architectures; cannot tell which model to build")
    raise ExportError(f"architecture '{architecture}' in config.json is not a transformers class")


def build_meta_model(config, trust_remote_code: bool) -> torch.nn.Module:
    """The model on the meta device: every name, shape and tie, and no memory."""
    try:
        with torch.device("meta"):
            return model_class(config).build(config, trust_remote_code)
    except ExportError:
        raise
    except Exception as error:  # noqa: BLE001 - model code raises anything
        raise ExportError(f"cannot build the model from config.json: {type(error).__name__}: {one_line(error)}") from None


def expected_tensors(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every state-dict name of the model (tied aliases included) with its shape and dtype."""
    return {
        name: (tuple(tensor.shape), dtype_name(tensor.dtype))
        for name, tensor in model.state_dict(keep_vars=True).items()
    }


def exported_config(raw_config: dict, dtype: str | None) -> dict:
    """config.json for the export: the dtype the weights were written in, and no None entries
    in `auto_map` (transformers rejects them)."""
    config = dict(raw_config)
    if dtype is not None:
        config["dtype"] = dtype
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype
    if isinstance(config.get("auto_map"), dict):
        config["auto_map"] = {key: value for key, value in config["auto_map"].items() if value is not None}
    return config
