"""Every layout rayexport reads, in the order `--layout auto` tries them, and the two questions
asked of a source folder: which checkpoint is there, and has its trainer finished writing it."""

from __future__ import annotations

from rayexport.common.errors import ExportError
from rayexport.layouts import AUTO, LAYOUT_NAMES
from rayexport.layouts.accelerate import AccelerateLayout
from rayexport.layouts.base import Checkpoint, Layout, SourceSettings
from rayexport.layouts.dcp import DcpLayout
from rayexport.layouts.deepspeed import DeepSpeedLayout
from rayexport.layouts.hf_sharded import ShardedSafetensorsLayout
from rayexport.layouts.megatron import MegatronLayout
from rayexport.layouts.torchtitan import TorchtitanLayout
from rayexport.layouts.verl import VerlLayout
from rayexport.storage.store import Store

LAYOUTS: tuple[Layout, ...] = (
    MegatronLayout(), DeepSpeedLayout(), TorchtitanLayout(), DcpLayout(), VerlLayout(), AccelerateLayout(),
    ShardedSafetensorsLayout(),
)
# What `auto` falls back to when no layout recognises the files: its errors name what is missing.
FALLBACK = VerlLayout()


def layout_named(name: str) -> Layout:
    """The layout `--layout NAME` selects."""
    for layout in LAYOUTS:
        if layout.name == name:
            return layout
    raise ExportError(f"unknown layout '{name}' (known: {', '.join(LAYOUT_NAMES)})")


def detect_layout(store: Store) -> Layout | None:
    """The first layout that recognises the files directly under `store`, or None."""
    names = store.list()
    return next((layout for layout in LAYOUTS if layout.detect(store, names)), None)


def find_checkpoint(store: Store, layout: str, settings: SourceSettings) -> Checkpoint:
    """The checkpoint at `store`, read by the layout `layout` names or, with `auto`, the one its
    files show."""
    chosen = layout_named(layout) if layout != AUTO else (detect_layout(store) or FALLBACK)
    return chosen.describe(store, settings)


def snapshot(store: Store) -> dict[str, int] | None:
    """Names and sizes of the checkpoint's files at `store`, or None while there is no complete
    checkpoint there yet (the trainer writes each layout's marker last)."""
    layout = detect_layout(store)
    return layout.snapshot(store, store.list()) if layout is not None else None
