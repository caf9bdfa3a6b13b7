"""PyTorch Distributed Checkpoint (DCP) layout: `__{rank}_{n}.distcp` files plus `.metadata`, as
FSDP2 training loops, torchtitan, accelerate and `torch.distributed.checkpoint.save` write them.

`.metadata` (every key's global shape, dtype and chunks) is unpickled from an allow-list
(`dcp_metadata`). Where the `.distcp` files are on a filesystem the workers see (local, shared,
or each on its own node's disk), the workers share the saved chunks by bytes and map each one
where it lies (`dcp_chunks`): no copy, and no local disk. From object storage,
`torch.distributed.checkpoint.load` without a process group fills whole tensors from the chunks
that hold them, one ranged request each, into one local spool file a worker memory-maps
(`dcp_spool`), so that its memory stays at about a chunk while it reads, and at the transfer
window after.
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
from rayexport.plan.schedule import assign_by_bytes, keep_ties_together
from rayexport.storage.store import Store

# torch.distributed.checkpoint (and `dcp_spool`, which uses it) are imported where a checkpoint is
# read, as in `dcp_metadata`.
if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from rayexport.layouts.dcp_spool import SpooledTensors

_DISTCP_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class DcpCheckpoint(Checkpoint):
    """The model tensors of one DCP checkpoint directory; any reader can read any whole tensor."""

    keys: KeyMapping = field(default_factory=KeyMapping)  # stored keys -> model keys
    tensors: dict[str, DcpTensor] = field(default_factory=dict)  # by model key
    unsafe_pickle: bool = False
    spools_remote_files = False  # a worker reads ranges of remote files into a spool of its own

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
        """Where the files are local (or on a filesystem every worker mounts, or each on its
        node's own disk, `file_readers`), each worker maps a byte-balanced share of the saved
        chunks in place, tied tensors' same boxes together. From object storage each worker
        reads a byte-balanced share of whole tensors, tied copies together, into its spool."""
        if self.store.is_local or file_readers is not None:
            return self._share_chunks(num_workers, aliases, load, file_readers)
        name_of = {key: name for name, key in model_names(self.tensors)[0].items()}
        sizes = {key: tensor.nbytes for key, tensor in self.tensors.items()}
        assignment = keep_ties_together(assign_by_bytes(sizes, num_workers), aliases, name_of)
        rank_infos = load({worker: TensorsPart(worker, keys) for worker, keys in enumerate(assignment) if keys})
        holders = {key: {rank: infos[key]} for rank, infos in rank_infos.items() for key in infos}
        return Loaded(rank_infos, holders, {worker: worker for worker in range(num_workers)})

    def _share_chunks(
        self, num_workers: int, aliases: dict[str, str], load: LoadStep, file_readers: dict[str, int] | None
    ) -> Loaded:
        from rayexport.layouts.dcp_chunks import list_chunks, share_chunks, slot_chunks

        name_of = {key: name for name, key in model_names(self.tensors)[0].items()}
        key_of = {name: key for key, name in name_of.items()}
        tie_groups = {key: key_of.get(aliases.get(name, name), key) for key, name in name_of.items()}
        chunks = list_chunks(self.tensors, read_metadata(self.store, self.unsafe_pickle), self.store.uri)
        parts: dict[int, ChunksPart] = {}
        worker_of_rank: dict[int, int] = {}
        for worker, share in sorted(share_chunks(chunks, num_workers, tie_groups, file_readers).items()):
            slots = {}
            for slot in slot_chunks(share):
                slots[len(worker_of_rank)] = tuple(slot)
                worker_of_rank[len(worker_of_rank)] = worker
            parts[worker] = ChunksPart(slots)
        rank_infos = load(parts)
        return Loaded(rank_infos, holders_by_key(rank_infos), worker_of_rank)

    def part_bytes(self, part: "TensorsPart | ChunksPart") -> int:
        """The bytes a worker reads for `part`."""
        return part.nbytes(self)

    def read(self, part: "TensorsPart | ChunksPart", spool_dir: str, spooled: Advance) -> dict[int, SourceTensors]:
        """The tensors of `part`: chunks mapped in place, or whole tensors read into this worker's spool."""
        return part.read(self, spool_dir)


@dataclass(frozen=True)
class TensorsPart:
    """Whole tensors (model keys) one worker reads, held as its pseudo-rank `rank`."""

    rank: int
    keys: list[str]

    def nbytes(self, checkpoint: DcpCheckpoint) -> int:
        return sum(checkpoint.tensors[key].nbytes for key in self.keys)

    def read(self, checkpoint: DcpCheckpoint, spool_dir: str) -> dict[int, SourceTensors]:
        return {self.rank: read_tensors(checkpoint, self.keys, spool_dir)}


@dataclass(frozen=True)
class ChunksPart:
    """Saved chunks one worker maps in place: pseudo-rank -> its chunks (`dcp_chunks.slot_chunks`)."""

    slots: dict[int, tuple]

    def nbytes(self, checkpoint: DcpCheckpoint) -> int:
        return sum(chunk.nbytes for chunks in self.slots.values() for chunk in chunks)

    def read(self, checkpoint: DcpCheckpoint, spool_dir: str) -> dict[int, SourceTensors]:
        from rayexport.layouts.dcp_chunks import read_in_place

        shapes = {key: tensor.shape for key, tensor in checkpoint.tensors.items()}
        return {
            rank: read_in_place(checkpoint.store, list(chunks), shapes, checkpoint.unsafe_pickle)
            for rank, chunks in self.slots.items()
        }


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


def read_tensors(checkpoint: DcpCheckpoint, keys: list[str], spool_dir: str) -> SpooledTensors:
    """Read the whole tensors `keys` (model keys) into one local file in `spool_dir`, memory-mapped;
    return them keyed by model key.

    `torch.distributed.checkpoint.load` runs without a process group and reads only the chunks
    of these tensors, from local files or, for a remote store, with one ranged request each.
    Each chunk is copied straight into its place in the mapped spool file and its pages given
    back, so this process holds about one chunk at a time, not its share of the model; the
    spool is also a snapshot, which later passes read rather than the source.
    Whole rank files are never spooled: every FSDP rank file holds a slice of every tensor, so
    that would copy the whole checkpoint to each worker.
    Tensor data is loaded with torch's weights-only unpickler; `.metadata` as
    `find_dcp_checkpoint` read it.
    """
    from rayexport.layouts.dcp_spool import SpooledTensors, spool

    store = checkpoint.store
    unknown = [key for key in keys if key not in checkpoint.tensors]
    if unknown:
        raise ExportError(f"no tensor '{unknown[0]}' in DCP checkpoint '{store.uri}'")
    if not keys:
        return SpooledTensors({}, None)
    metadata = _unchanged_metadata(checkpoint, keys)
    wanted = [checkpoint.tensors[key] for key in keys]
    state, path = spool(store, metadata, wanted, spool_dir)
    return SpooledTensors({key: state[tensor.key] for key, tensor in zip(keys, wanted)}, path)


def _unchanged_metadata(checkpoint: DcpCheckpoint, keys: list[str]) -> Metadata:
    """The checkpoint's `.metadata` read again, refusing a change to any of `keys` since it was listed."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    store = checkpoint.store
    metadata = read_metadata(store, checkpoint.unsafe_pickle)
    for key in keys:
        expected = checkpoint.tensors[key]
        entry = metadata.state_dict_metadata.get(expected.key)
        if not isinstance(entry, TensorStorageMetadata) or describe_entry(store, expected.key, entry) != expected:
            raise ExportError(f"tensor '{expected.key}' of DCP checkpoint '{store.uri}' changed since it was listed")
    return metadata
