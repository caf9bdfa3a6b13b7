"""rayexport: sharded FSDP training checkpoints to Hugging Face models, with Ray.

The names below are imported on first use, so that `python -m rayexport.run` can start Ray
before it imports torch and transformers."""

from __future__ import annotations

import importlib
from typing import Any

_MODULE_OF = {
    "ExportError": "rayexport.common.errors",
    "ExportFailed": "rayexport.remote",
    "ExportOptions": "rayexport.orchestration.options",
    "ExportReport": "rayexport.orchestration.report",
    "close_pool": "rayexport.orchestration.pool",
    "dry_run": "rayexport.orchestration.dry_run",
    "export": "rayexport.orchestration.job",
    "export_remote": "rayexport.remote",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'rayexport' has no attribute '{name}'")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
