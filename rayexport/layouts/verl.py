"""verl's FSDP layout: `model_world_size_{W}_rank_{r}.pt` files, `fsdp_config.json`, `huggingface/`."""

from __future__ import annotations

import logging
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from rayexport.common.errors import ExportError
from rayexport.layouts.base import (
    HF_DIR, Advance, Checkpoint, Loaded, LoadStep, MappedTensors, SourceSettings, SourceTensors, marker_snapshot,
    rank_parts,
)
from rayexport.layouts.mapped import local_file
from rayexport.plan.pieces import holders_from_ranks, needed_ranks
from rayexport.plan.schedule import assign_ranks
from rayexport.plan.shards import ShardInfo, describe_tensor, local_tensor
from rayexport.storage.store import Store

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
FSDP_CONFIG = "fsdp_config.json"
LORA_META = "lora_train_meta.json"


def rank_file_name(world_size: int, rank: int) -> str:
    return f"model_world_size_{world_size}_rank_{rank}.pt"


@dataclass(frozen=True)
class VerlCheckpoint(Checkpoint):
    """One verl checkpoint prefix (e.g. `.../global_step_100/actor`): a rank file per rank,
    each holding that rank's slice of every tensor."""

    fsdp_version: int | None = None
    rank_files: tuple[str, ...] = ()
    unsafe_pickle: bool = False

    def read_files(self) -> dict[str, int]:
        """The rank files, with their sizes."""
        return {name: self.store.size(name) for name in self.rank_files}

    def share(
        self, num_workers: int, aliases: dict[str, str], load: LoadStep, file_readers: dict[str, int] | None = None
    ) -> Loaded:
        """Rank 0's file (read by worker 0) tells which ranks hold data not found elsewhere
        (HSDP replicas are skipped); those are spread over the workers (or read where
        `file_readers` says), whole files each. Beside rank 0, the other workers read ranks 1,
        2, ... in the same step: FSDP needs every rank, and HSDP's ("ddp", "fsdp") mesh puts
        its first replica on the lowest ranks (a rank that turns out not to be needed, in a
        mesh of another order, is left out)."""
        lowest = list(range(min(num_workers, self.world_size)))
        if file_readers is None:
            first = {rank: rank for rank in lowest}  # rank r on worker r, not in blocks
        else:
            first = self._readers(lowest, num_workers, file_readers)
        rank_infos = load(rank_parts(first))
        ranks = needed_ranks(rank_infos[0], self.world_size)
        rank_infos = {rank: infos for rank, infos in rank_infos.items() if rank in ranks}
        worker_of_rank = {rank: first[rank] for rank in rank_infos}
        rest = [rank for rank in ranks if rank not in rank_infos]
        worker_of_rank.update(self._readers(rest, num_workers, file_readers))
        if rest:
            rank_infos.update(load(rank_parts({rank: worker_of_rank[rank] for rank in rest})))
        return Loaded(rank_infos, holders_from_ranks(rank_infos), worker_of_rank)

    def _readers(self, ranks: list[int], num_workers: int, file_readers: dict[str, int] | None) -> dict[int, int]:
        """The worker that reads each of `ranks`: where `file_readers` puts its file, else in
        contiguous blocks."""
        if file_readers is None:
            return assign_ranks(ranks, num_workers) if ranks else {}
        return {rank: file_readers[self.rank_files[rank]] for rank in ranks}

    def part_bytes(self, part: list[int]) -> int:
        """The bytes of the rank files `part`."""
        return sum(self.store.size(self.rank_files[rank]) for rank in part)

    def read(self, part: list[int], spool_dir: str, spooled: Advance) -> dict[int, SourceTensors]:
        """The rank files `part`, memory-mapped (remote ones spooled to local disk first)."""
        states: dict[int, SourceTensors] = {}
        for rank in part:
            state, path = load_rank_state(self.store, self.rank_files[rank], spool_dir, self.unsafe_pickle, spooled)
            states[rank] = RankTensors(state, rank, path, os.path.getsize(path))
        return states


class RankTensors(MappedTensors):
    """One rank file's state dict, memory-mapped: (D)Tensors by key."""

    def __init__(self, state: dict[str, torch.Tensor], rank: int, path: str, file_size: int) -> None:
        super().__init__(state, path)
        self.rank, self.file_size = rank, file_size

    def describe(self, advance: Advance = lambda count: None) -> dict[str, ShardInfo]:
        """Each tensor's placement; `advance` gets each tensor's share of the file's bytes, so a
        bar of the files' bytes ends at their size."""
        scale = self.file_size / max(1, sum(local_tensor(value).nbytes for value in self.tensors.values()))
        infos, meshes = {}, {}
        for key, value in self.tensors.items():
            infos[key] = describe_tensor(value, self.rank, meshes)
            advance(round(local_tensor(value).nbytes * scale))
        return infos


class VerlLayout:
    """verl's FSDP layout (also SkyRL's FSDP backend)."""

    name = "verl"

    def detect(self, store: Store, names: list[str]) -> bool:
        return any(RANK_FILE.match(name) for name in names)

    def describe(self, store: Store, settings: SourceSettings) -> VerlCheckpoint:
        return find_verl_checkpoint(store, settings.unsafe_pickle)

    def snapshot(self, store: Store, names: list[str]) -> dict[str, int] | None:
        return marker_snapshot(store, names, FSDP_CONFIG)  # verl writes fsdp_config.json last


def find_verl_checkpoint(store: Store, unsafe_pickle: bool = False) -> VerlCheckpoint:
    """Describe the checkpoint at `store`, or raise naming what is missing or inconsistent."""
    if not store.exists():
        raise ExportError(f"source '{store.uri}' does not exist")
    names = store.list()
    if not names and not store.list(HF_DIR):
        raise ExportError(f"source '{store.uri}' is empty")
    fsdp_version = None
    configured_world_size = None
    if FSDP_CONFIG in names:
        fsdp_config = store.read_json(FSDP_CONFIG)
        if not isinstance(fsdp_config, dict):
            raise ExportError(f"'{store.display(FSDP_CONFIG)}' is not a JSON object")
        fsdp_version = fsdp_config.get("FSDP_version")
        configured_world_size = fsdp_config.get("world_size")
    found: dict[int, dict[int, str]] = {}
    for name in names:
        match = RANK_FILE.match(name)
        if match:
            world_size, rank = int(match.group(1)), int(match.group(2))
            found.setdefault(world_size, {})[rank] = name
    if not found:
        raise ExportError(f"no rank files model_world_size_*_rank_*.pt in '{store.uri}'")
    if len(found) > 1:
        sizes = ", ".join(str(size) for size in sorted(found))
        raise ExportError(f"rank files of several world sizes ({sizes}) in '{store.uri}'")
    world_size, ranks = next(iter(found.items()))
    if configured_world_size is not None and configured_world_size != world_size:
        raise ExportError(
            f"'{store.display(FSDP_CONFIG)}' says world_size {configured_world_size} "
            f"but the rank files are for world size {world_size}"
        )
    missing = [rank for rank in range(world_size) if rank not in ranks]
    if missing and store.nowhere():
        plural = "s" if len(missing) > 1 else ""
        raise ExportError(f"rank file{plural} {spans(missing)} of world size {world_size} {'are' if plural else 'is'} {store.nowhere()}")
    if missing:
        raise ExportError(f"missing rank file '{store.display(rank_file_name(world_size, missing[0]))}'")
    extra = sorted(rank for rank in ranks if rank >= world_size)
    if extra:
        raise ExportError(f"unexpected rank file '{store.display(ranks[extra[0]])}'")
    return VerlCheckpoint(
        store=store,
        world_size=world_size,
        layout=f"verl-fsdp{fsdp_version}" if fsdp_version else "verl-fsdp",
        hf_folder=store.child(HF_DIR),
        lora_meta=store.read_json(LORA_META) if LORA_META in names else None,
        fsdp_version=fsdp_version,
        rank_files=tuple(ranks[rank] for rank in range(world_size)),
        unsafe_pickle=unsafe_pickle,
    )


def spans(numbers: list[int]) -> str:
    """Sorted numbers as runs, for messages: [0, 1, 2, 5] -> '0-2, 5'."""
    runs: list[list[int]] = []
    for number in sorted(numbers):
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


def load_rank_state(
    store: Store, name: str, spool_dir: str, unsafe_pickle: bool = False, progress: Callable[[int], Any] = lambda count: None
) -> tuple[dict[str, torch.Tensor], str]:
    """Load one rank file memory-mapped, with the weights-only unpickler (tensors, DTensors and
    their placements only) unless `unsafe_pickle`, which runs arbitrary pickled code. Returns
    the state and the local file it maps.

    A remote file is spooled to local disk first so that it too is memory-mapped rather than
    held in RAM; `progress` gets each count of bytes spooled.
    """
    import torch.distributed.tensor  # noqa: F401 - registers DTensor for weights_only loading

    path = local_file(store, name, spool_dir, progress)
    try:
        state = torch.load(path, map_location="cpu", weights_only=not unsafe_pickle, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ExportError(f"rank file '{store.display(name)}' cannot be loaded: {reason}") from None
    if not isinstance(state, dict) or not all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in state.items()
    ):
        raise ExportError(f"rank file '{store.display(name)}' is not a model state dict")
    return state, path
