"""Remote code (config `auto_map`): which files an export needs, and bundling them from the
model's class module when the checkpoint does not carry them (BRIEF 1.2 is fixed here)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def auto_map_files(raw_config: dict[str, Any]) -> list[str]:
    """The Python files `auto_map` points to (`repo--module.Class` or `module.Class`)."""
    files = set()
    for reference in (raw_config.get("auto_map") or {}).values():
        for item in reference if isinstance(reference, (list, tuple)) else [reference]:
            if isinstance(item, str) and "." in item:
                module = item.split("--")[-1].rsplit(".", 1)[0]
                files.add(module.replace(".", "/") + ".py")
    return sorted(files)


def unwrap_peft(model: torch.nn.Module) -> torch.nn.Module:
    """The base model inside a PEFT wrapper (`get_base_model()` is PEFT's own); others as they are."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def bundle_model_code(model: torch.nn.Module, folder: str) -> list[str]:
    """Copy the source of the model's class module, and the relative imports it makes, into
    `folder` with transformers' `custom_object_save`, always on the base model: walking a PEFT
    wrapper's module would copy peft's or torch's files instead of the modeling file."""
    from transformers.dynamic_module_utils import custom_object_save

    saved = custom_object_save(unwrap_peft(model), folder) or []
    return sorted(os.path.relpath(path, folder) for path in saved)
