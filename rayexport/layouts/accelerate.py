"""accelerate's checkpoint folders (`save_state`; transformers' Trainer and TRL under FSDP's
sharded state dict): each model saved as DCP in a folder of its own, `pytorch_model_fsdp_<i>/`,
beside `optimizer_<i>/`, and config and tokenizer in the Trainer folder itself."""

from __future__ import annotations

import logging
import re

from rayexport.common.errors import ExportError
from rayexport.layouts.base import SourceSettings
from rayexport.layouts.dcp import DcpCheckpoint, DcpLayout
from rayexport.storage.store import Store

log = logging.getLogger(__name__)

MODEL_FOLDER = re.compile(r"^pytorch_model_fsdp_\d+$")


def model_folder(store: Store) -> str | None:
    """The model folder of an accelerate checkpoint at `store`: its one `pytorch_model_fsdp_<i>/`,
    None where it holds none. Several (one per model) are refused, naming them."""
    found = [name for name in store.folders() if MODEL_FOLDER.match(name)]
    if len(found) > 1:
        raise ExportError(
            f"'{store.uri}' holds {len(found)} model checkpoints ({', '.join(found)}); pass the one to export as --src"
        )
    return found[0] if found else None


class AccelerateLayout:
    """A Trainer/accelerate checkpoint folder, read from its one model folder (DCP)."""

    name = "accelerate"

    def detect(self, store: Store, names: list[str]) -> bool:
        return model_folder(store) is not None

    def describe(self, store: Store, settings: SourceSettings) -> DcpCheckpoint:
        folder = model_folder(store)
        if folder is None:
            raise ExportError(f"no accelerate model folder pytorch_model_fsdp_<i>/ in '{store.uri}'")
        log.info("reading the model checkpoint '%s'", store.display(folder))
        return DcpLayout().describe(store.child(folder), settings)  # config and tokenizer: the folder above

    def snapshot(self, store: Store, names: list[str]) -> dict[str, int] | None:
        folder = model_folder(store)
        model = store.child(folder)
        found = DcpLayout().snapshot(model, model.list())
        return None if found is None else {f"{folder}/{name}": size for name, size in found.items()}
