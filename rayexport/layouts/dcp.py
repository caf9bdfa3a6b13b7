"""PyTorch Distributed Checkpoint (DCP) layout: `__{rank}_{n}.distcp` files plus `.metadata`, as
FSDP2 training loops, torchtitan, accelerate and `torch.distributed.checkpoint.save` write them.

`.metadata` (every key's global shape, dtype and chunks) is unpickled from an allow-list
(`dcp_metadata`). The workers share the saved chunks by bytes, and read each one where it lies
(`dcp_chunks`): on a filesystem they see (local, shared, or each file on its node's own disk)
memory-mapped, from object storage the byte range of each piece the transfer sends, when it sends
it. Nothing is copied to local disk, and a worker holds at most the transfer window.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from rayexport.common.errors import ExportError
from rayexport.layouts.base import (
    HF_DIR, Advance, Checkpoint, KeyMapping, Loaded, LoadStep, SourceSettings, SourceTensors, marker_snapshot,
)
from rayexport.layouts.dcp_metadata import (
    DCP_METADATA, NON_MODEL_NAMES, DcpTensor, describe_entry, detect_prefix, first_name, read_metadata,
)
from rayexport.plan.naming import model_names
from rayexport.plan.pieces import holders_by_key
from rayexport.plan.shards import ShardInfo
from rayexport.storage.store import Store

# torch.distributed.checkpoint is imported where a checkpoint is read, as in `dcp_metadata`.
if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

_DISTCP_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class DcpCheckpoint(Checkpoint):
    """The model tensors of one DCP checkpoint directory; any worker can read any saved chunk."""

    keys: KeyMapping = field(default_factory=KeyMapping)  # stored keys -> model keys
    tensors: dict[str, DcpTensor] = field(default_factory=dict)  # by model key
    unsafe_pickle: bool = False
    spools_remote_files = False  # a worker fetches the byte ranges it sends, never a whole file

    @property
    def prefix(self) -> str:
        return self.keys.prefix

    def known_keys(self) -> list[str]:
        """The model keys `.metadata` lists."""
        return list(self.tensors)

    def read_files(self) -> dict[str, int]:
        """The `.distcp` files, with their sizes."""
        return {name: self.store.size(name) for name in self.store.list() if _DISTCP_FILE.match(name)}

    def share(
        self, num_workers: int, aliases: dict[str, str], load: LoadStep, file_readers: dict[str, int] | None = None
    ) -> Loaded:
        """Each worker reads a byte-balanced share of the saved chunks, tied tensors' same boxes
        together, each chunk where it lies (`dcp_chunks`); where `file_readers` places the files
        (each on its node's own disk), each chunk on its file's reader."""
        from rayexport.layouts.dcp_chunks import list_chunks, share_chunks, slot_chunks

        name_of = {key: name for name, key in model_names(self.tensors)[0].items()}
        key_of = {name: key for key, name in name_of.items()}
        tie_groups = {key: key_of.get(aliases.get(name, name), key) for key, name in name_of.items()}
        chunks = list_chunks(self.tensors, read_metadata(self.store, self.unsafe_pickle), self.store.uri)
        parts: dict[int, ChunksPart] = {}
        worker_of_rank: dict[int, int] = {}
        for worker, share in sorted(share_chunks(chunks, num_workers, tie_groups, file_readers).items()):
            slots = {}
            for slot in slot_chunks(share, tie_groups):
                slots[len(worker_of_rank)] = tuple(slot)
                worker_of_rank[len(worker_of_rank)] = worker
            parts[worker] = ChunksPart(slots)
        rank_infos = load(parts)
        return Loaded(rank_infos, holders_by_key(rank_infos), worker_of_rank)

    def part_bytes(self, part: ChunksPart) -> int:
        """The bytes a worker reads for `part`."""
        return sum(chunk.nbytes for chunks in part.slots.values() for chunk in chunks)

    def describe_part(self, part: ChunksPart) -> dict[int, dict[str, ShardInfo]]:
        """Each pseudo-rank's chunks, placed from `.metadata` alone."""
        from rayexport.layouts.dcp_chunks import describe_chunks

        shapes = {key: tensor.shape for key, tensor in self.tensors.items()}
        return {rank: describe_chunks({chunk.key: chunk for chunk in chunks}, shapes) for rank, chunks in part.slots.items()}

    def read(self, part: ChunksPart, spool_dir: str, spooled: Advance) -> dict[int, SourceTensors]:
        """The chunks of `part`, each pseudo-rank's mapped in place, or from object storage
        fetched piece by piece as the transfer asks (nothing spooled)."""
        from rayexport.layouts.dcp_chunks import read_in_place, read_remote

        shapes = {key: tensor.shape for key, tensor in self.tensors.items()}
        read = read_in_place if self.store.is_local else read_remote
        return read(self.store, {rank: list(chunks) for rank, chunks in part.slots.items()}, shapes, self.unsafe_pickle)


@dataclass(frozen=True)
class ChunksPart:
    """The saved chunks one worker reads: pseudo-rank -> its chunks (`dcp_chunks.slot_chunks`)."""

    slots: dict[int, tuple]


class DcpLayout:
    """PyTorch Distributed Checkpoint directories (FSDP2 loops, torchtitan, RL trainers' DCP saves)."""

    name = "dcp"

    def detect(self, store: Store, names: list[str]) -> bool:
        return DCP_METADATA in names or any(_DISTCP_FILE.match(name) for name in names)

    def describe(self, store: Store, settings: SourceSettings) -> DcpCheckpoint:
        checkpoint = find_dcp_checkpoint(store, settings.key_prefix, unsafe_pickle=settings.unsafe_pickle)
        parent = store.parent()
        if parent is not None and parent.exists("config.json"):  # ROLL saves the HF model beside its dcp/
            return replace(checkpoint, nearby_hf_folder=parent)
        return checkpoint

    def snapshot(self, store: Store, names: list[str]) -> dict[str, int] | None:
        return marker_snapshot(store, names, DCP_METADATA)  # DCP writes .metadata last


def find_dcp_checkpoint(store: Store, prefix: str | None = None, *, unsafe_pickle: bool = False) -> DcpCheckpoint:
    """Describe the model tensors of the DCP checkpoint at `store` from its `.metadata`.

    `prefix` is the part of the stored keys to strip to get model keys ("model.", "app.model.",
    "" ...; a missing final "." is added); by default it is detected from how the state dict was
    nested when saved. Optimizer,
    scheduler and other training state, and every non-tensor entry, go to `skipped`. Raises
    ExportError when `.metadata` is missing or unreadable, or no model tensor is found.

    `.metadata` is a pickle: it is unpickled allowing only the classes DCP metadata is made of,
    unless `unsafe_pickle`, which unpickles it as torch does, running any code it holds.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(store, unsafe_pickle)
    entries = metadata.state_dict_metadata
    tensor_keys = [key for key, value in entries.items() if isinstance(value, TensorStorageMetadata)]
    if not tensor_keys:
        raise ExportError(f"DCP checkpoint '{store.uri}' holds no tensors")
    if prefix is None:
        prefix = detect_prefix(tensor_keys, metadata.planner_data, store.uri)
    elif prefix and not prefix.endswith("."):
        prefix += "."
    keys = KeyMapping(prefix)
    tensors: dict[str, DcpTensor] = {}
    skipped = [key for key, value in entries.items() if not isinstance(value, TensorStorageMetadata)]
    for key in tensor_keys:
        model_key = keys.model_key(key)
        if not model_key or first_name(model_key) in NON_MODEL_NAMES:
            skipped.append(key)
            continue
        tensors[model_key] = describe_entry(store, key, entries[key])
    if not tensors:
        raise ExportError(f"no model tensors under key prefix '{prefix}' in DCP checkpoint '{store.uri}'")
    names = store.list()
    missing = sorted(_files_of(metadata, {tensor.key for tensor in tensors.values()}) - set(names))
    if missing and store.nowhere():
        raise ExportError(f"DCP files {', '.join(missing)} of '{store.uri}' are {store.nowhere()}")
    if missing:
        raise ExportError(f"DCP checkpoint '{store.uri}' is missing '{missing[0]}'")
    ranks = {match.group(1) for match in map(_DISTCP_FILE.match, names) if match}
    return DcpCheckpoint(
        store=store, world_size=len(ranks), layout="dcp",
        hf_folder=store.child(HF_DIR),
        skipped=sorted(skipped), keys=keys, tensors=tensors, unsafe_pickle=unsafe_pickle,
    )


def _files_of(metadata: Metadata, stored_keys: set[str]) -> set[str]:
    """The files that hold chunks of `stored_keys`, as `.metadata` records them."""
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    return {info.relative_path for index, info in storage.items() if index.fqn in stored_keys and hasattr(info, "relative_path")}
