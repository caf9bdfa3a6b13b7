"""torchtitan's checkpoints (`<dump>/checkpoint/step-N/`): DCP, model tensors at the top level
under torchtitan's own names (`tok_embeddings.weight`, `layers.N.attention.wq.weight`, ...),
beside optimizer, scheduler, dataloader and train state in periodic saves. They are read as
any DCP checkpoint; planning maps the names to the model's on-disk ones as torchtitan's
`to_hf` does (`rayexport.plan.torchtitan`). torchtitan saves no config or tokenizer: those
come from `--hf-config`."""

from __future__ import annotations

import dataclasses
import logging

from rayexport.errors import ExportError
from rayexport.layouts.base import SourceSettings
from rayexport.layouts.dcp import DcpCheckpoint, DcpLayout
from rayexport.layouts.dcp_metadata import DCP_METADATA, read_metadata
from rayexport.plan.torchtitan import PRODUCER, torchtitan_names, torchtitan_namings
from rayexport.storage import Store

log = logging.getLogger(__name__)


class TorchtitanLayout:
    """A torchtitan step folder: a DCP checkpoint whose tensors carry torchtitan's names."""

    name = PRODUCER

    def detect(self, store: Store, names: list[str]) -> bool:
        if DCP_METADATA not in names:
            return False
        try:
            keys = read_metadata(store).state_dict_metadata
        except ExportError:
            return False  # the DCP layout reports what is wrong with it
        return bool(torchtitan_names(keys))

    def describe(self, store: Store, settings: SourceSettings) -> DcpCheckpoint:
        checkpoint = DcpLayout().describe(store, settings)
        found = torchtitan_names(checkpoint.tensors)
        if not found:
            raise ExportError(
                f"DCP checkpoint '{store.uri}' holds no tensor under torchtitan's names "
                f"(first: '{next(iter(checkpoint.tensors))}')"
            )
        log.info("torchtitan names (%s, ...): mapped to the model's as torchtitan's to_hf does", found[0])
        return dataclasses.replace(checkpoint, layout=PRODUCER, producer_namings=torchtitan_namings)

    def snapshot(self, store: Store, names: list[str]) -> dict[str, int] | None:
        return DcpLayout().snapshot(store, names)
