"""Megatron-Core `torch_dist` checkpoints: what verl's Megatron backend, Megatron-LM and the
trainers built on either save. The folder of the files (`.metadata`, `__R_K.distcp`, `common.pt`
and `metadata.json`, `{"sharded_backend": "torch_dist", ...}`, written last) is a DCP checkpoint
whose tensors carry Megatron-Core's names, read as any DCP checkpoint; planning maps the names
to the model's on-disk ones (`rayexport.plan.megatron`). `--src` may name that folder, or:
- verl's `<step>/actor/` (newer verl: `<ckpt>/model/`), holding `dist_ckpt/` and the
  Hugging Face config and tokenizer in `huggingface/`;
- a Megatron-LM save folder, whose `latest_checkpointed_iteration.txt` names the iteration
  folder (`iter_0000100/`, or `release/`). Megatron-LM saves no Hugging Face config: it comes
  from `--hf-config`.
"""

from __future__ import annotations

import dataclasses
import logging
import re

from rayexport.common.errors import ExportError
from rayexport.layouts.base import HF_DIR, SourceSettings, marker_snapshot
from rayexport.layouts.dcp import DcpCheckpoint, find_dcp_checkpoint
from rayexport.layouts.dcp_metadata import DCP_METADATA
from rayexport.plan.megatron import PRODUCER, megatron_names, megatron_namings
from rayexport.storage.store import Store

log = logging.getLogger(__name__)

MEGATRON_METADATA = "metadata.json"  # Megatron's dist_checkpointing config, written last
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's pointer to its newest iteration
DIST_CKPT = "dist_ckpt"  # verl's folder for the torch_dist files
RELEASE = "release"
# Training state Megatron saves beside the model: the optimizer's (the distributed optimizer's
# under `chained_N.optimizer.`) and the RNG's.
TRAINING_STATE = re.compile(r"^((chained_\d+\.)?optimizer\.|rng_state)")
# Files that show a folder is some other layout's, so that detection asks no more of it.
_OTHER_CHECKPOINT_FILES = (".pt", ".bin", ".safetensors", ".distcp")


class MegatronLayout:
    """A Megatron-Core torch_dist checkpoint, its folder or the folder that holds it."""

    name = PRODUCER

    def detect(self, store: Store, names: list[str]) -> bool:
        if MEGATRON_METADATA in names:
            return _is_torch_dist(store)
        if TRACKER in names:
            return True
        if DCP_METADATA in names or any(name.endswith(_OTHER_CHECKPOINT_FILES) for name in names):
            return False
        return store.exists(f"{DIST_CKPT}/{MEGATRON_METADATA}")

    def describe(self, store: Store, settings: SourceSettings) -> DcpCheckpoint:
        folder, hf = checkpoint_folder(store, settings.step)
        backend = _backend(folder)
        if backend is None:
            raise ExportError(f"missing '{folder.display(MEGATRON_METADATA)}', the config Megatron-Core's save writes last")
        if backend != "torch_dist":
            raise ExportError(
                f"'{folder.display(MEGATRON_METADATA)}' names sharded backend '{backend}'; rayexport reads "
                f"Megatron-Core's torch_dist checkpoints"
            )
        checkpoint = find_dcp_checkpoint(folder, settings.key_prefix or "", unsafe_pickle=settings.unsafe_pickle)
        state = sorted(key for key in checkpoint.tensors if TRAINING_STATE.match(key))
        tensors = {key: tensor for key, tensor in checkpoint.tensors.items() if key not in state}
        saved = {key: (tensor.shape, tensor.dtype) for key, tensor in tensors.items()}
        found = megatron_names(saved)
        if not found:
            raise ExportError(
                f"torch_dist checkpoint '{folder.uri}' holds no tensor under Megatron-Core's names "
                f"(first: '{next(iter(saved))}')"
            )
        log.info("Megatron-Core names (%s, ...) in %s: mapped to the model's", found[0], folder.uri)
        return dataclasses.replace(
            checkpoint, layout=PRODUCER, hf_folder=hf, producer_namings=megatron_namings(saved), tensors=tensors,
            skipped=sorted(checkpoint.skipped + [checkpoint.tensors[key].key for key in state]),
        )

    def snapshot(self, store: Store, names: list[str]) -> dict[str, int] | None:
        try:
            folder, _ = checkpoint_folder(store, names=names)
        except ExportError:
            return None  # no iteration folder, or not the tracked one, written yet
        below = folder.uri[len(store.uri):].strip("/")
        files = folder.list() if below else names
        if DCP_METADATA not in files:
            return None
        found = marker_snapshot(folder, files, MEGATRON_METADATA)
        return None if found is None else {f"{below}/{name}" if below else name: size for name, size in found.items()}


def checkpoint_folder(store: Store, step: int | None = None, names: list[str] | None = None) -> tuple[Store, Store]:
    """The folder of the torch_dist files that `store` (whose files are `names`, when listed
    already) names (of a Megatron-LM save folder, its iteration `step`, by default the tracked
    one), and where the Hugging Face config and tokenizer would be beside it (verl's `huggingface/`)."""
    names = store.list() if names is None else names
    if step is not None:
        return store.child(_iteration(store, step)), store.child(HF_DIR)
    if MEGATRON_METADATA in names or DCP_METADATA in names:
        parent = store.parent()
        return store, (parent or store).child(HF_DIR)
    if TRACKER in names:
        return store.child(_tracked_iteration(store)), store.child(HF_DIR)
    folder = store.child(DIST_CKPT)
    if not folder.exists(MEGATRON_METADATA):
        raise ExportError(
            f"no Megatron-Core checkpoint at '{store.uri}': no '{MEGATRON_METADATA}', '{DIST_CKPT}/' or '{TRACKER}'"
        )
    return folder, store.child(HF_DIR)


def _tracked_iteration(store: Store) -> str:
    """The iteration folder Megatron-LM's tracker file names: `iter_0000100`, or `release`."""
    text = store.read_bytes(TRACKER).decode(errors="replace").strip()
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise ExportError(f"'{store.display(TRACKER)}' holds '{text[:40]}', not an iteration number or '{RELEASE}'")
    return _iteration(store, int(text), f"'{store.display(TRACKER)}' names")


def _iteration(store: Store, step: int, named_by: str = "--step names") -> str:
    """The folder of iteration `step` in a Megatron-LM save folder, or one line saying it holds
    no checkpoint and which iterations there are."""
    folder = f"iter_{step:07d}"
    if store.exists(f"{folder}/{MEGATRON_METADATA}"):
        return folder
    there = [name for name in store.folders() if name.startswith("iter_")]
    raise ExportError(
        f"{named_by} iteration {step}, but '{store.display(folder)}/' holds no checkpoint"
        + (f" (there: {', '.join(there[-3:])})" if there else "")
    )


def _backend(folder: Store) -> str | None:
    """The sharded backend `metadata.json` names (None: no such file, or not a JSON object)."""
    try:
        config = folder.read_json(MEGATRON_METADATA)
    except ExportError:
        return None
    return config.get("sharded_backend") if isinstance(config, dict) else None


def _is_torch_dist(folder: Store) -> bool:
    return _backend(folder) == "torch_dist"
