"""Importing Megatron-Bridge 0.6.2 on Python 3.11 without TransformerEngine: what
`megatron_bridge_tables.py` and the tests' Megatron-Bridge writer (`tests/support/megatron_bridge_save.py`)
call first. Megatron-Bridge declares Python 3.12 and imports TransformerEngine unguarded in one
module; these are the two smallest ways past, each touching only what that module needs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
import typing

LORA_LAYERS = "megatron.bridge.peft.lora_layers"


class _LoraLayersWithoutTransformerEngine(importlib.abc.MetaPathFinder):
    """`megatron.bridge.peft.lora_layers` imports `transformer_engine.pytorch` unguarded, and only
    names its classes in annotations and isinstance tests (`te.Linear`, `te.LayerNormLinear`,
    `te.ops.Sequential`). While that one module executes, those names are classes nothing is an
    instance of; the stand-in is gone from `sys.modules` before any other module can see it, so
    Megatron-Core's own TransformerEngine checks still find none."""

    def find_spec(self, name, path=None, target=None):
        if name != LORA_LAYERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        execute = spec.loader.exec_module

        def exec_module(module):
            absent = type("AbsentTransformerEngineClass", (), {})
            pytorch = types.ModuleType("transformer_engine.pytorch")
            pytorch.Linear = pytorch.LayerNormLinear = absent
            pytorch.ops = types.SimpleNamespace(Sequential=absent)
            package = types.ModuleType("transformer_engine")
            package.pytorch = pytorch
            sys.modules.update({"transformer_engine": package, "transformer_engine.pytorch": pytorch})
            try:
                execute(module)
            finally:
                del sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"]

        spec.loader.exec_module = exec_module
        return spec


def import_megatron_bridge() -> types.ModuleType:
    """`megatron.bridge`, imported with the two stand-ins above in place."""
    import typing_extensions

    if not hasattr(typing, "override"):  # Python 3.12's, used by `megatron/training/models/gpt.py`
        typing.override = typing_extensions.override
    if not any(isinstance(finder, _LoraLayersWithoutTransformerEngine) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LoraLayersWithoutTransformerEngine())
    import megatron.bridge

    return megatron.bridge
