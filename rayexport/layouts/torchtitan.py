"""torchtitan's checkpoints (`<dump>/checkpoint/step-N/`): DCP, model tensors at the top level
under torchtitan's own names (`tok_embeddings.weight`, `layers.N.attention.wq.weight`, ...),
beside optimizer, scheduler, dataloader and train state in periodic saves. They are read as
any DCP checkpoint; planning maps the names to the model's on-disk ones as torchtitan's
`to_hf` does (`rayexport.plan.torchtitan`). torchtitan saves no config or tokenizer: those
come from `--hf-config`."""

from __future__ import annotations

import dataclasses
import logging
import re

from rayexport.common.errors import ExportError
from rayexport.layouts.base import SourceSettings
from rayexport.layouts.dcp import DcpCheckpoint, DcpLayout
from rayexport.layouts.dcp_metadata import DCP_METADATA, read_metadata
from rayexport.plan.torchtitan import PRODUCER, torchtitan_names, torchtitan_namings
from rayexport.storage.store import Store

log = logging.getLogger(__name__)

# MoE state `to_hf` drops: the load-balancing routing bias and token counts, which Hugging Face's
# MoE models have no place for.
DROPPED = re.compile(r"^layers\.\d+\.moe\.(expert_bias|tokens_per_expert)(_E)?$")


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
        dropped = sorted(key for key in checkpoint.tensors if DROPPED.match(key))
        if dropped:
            log.warning(
                "not exported, as torchtitan's to_hf drops them: %s (MoE load balancing state; where the routing bias is "
                "not zero, the exported model routes some tokens otherwise than training did)", ", ".join(dropped)
            )
        return dataclasses.replace(
            checkpoint, layout=PRODUCER, producer_namings=torchtitan_namings,
            tensors={key: tensor for key, tensor in checkpoint.tensors.items() if key not in dropped},
            skipped=sorted(checkpoint.skipped + [checkpoint.tensors[key].key for key in dropped]),
        )

    def snapshot(self, store: Store, names: list[str]) -> dict[str, int] | None:
        return DcpLayout().snapshot(store, names)
