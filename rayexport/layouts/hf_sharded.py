"""torch's sharded Hugging Face safetensors (`HuggingFaceStorageWriter(save_distributed=True)`):
`shard-{S}-model-{K}-of-{N}.safetensors` for each training rank S (counted from 1) and output
file K, each header recording where its piece of each tensor starts in the full tensor
(`saved_offsets`); the full shape is where the pieces end. torchtitan's `last_save_in_hf` leaves
them in `sharded/`, its merged files beside it; NeMo Automodel and NeMo-RL in `model/`, config
and tokenizer in its `.hf_metadata/`. Each rank's files are read whole, memory-mapped, by one
worker, as verl's rank files are."""

from __future__ import annotations

import concurrent.futures
import re
from dataclasses import dataclass, field

from rayexport.common.errors import ExportError, one_line
from rayexport.layouts.base import HF_DIR, Advance, Checkpoint, Loaded, LoadStep, load_ranks, SourceSettings, SourceTensors
from rayexport.layouts.hf import SafetensorsFiles
from rayexport.layouts.hf_sharded_headers import Piece, full_shape, header_pieces, read_header
from rayexport.layouts.mapped import local_file, mapped_ranges
from rayexport.layouts.verl import spans
from rayexport.plan.schedule import assign_ranks
from rayexport.plan.shards import ShardInfo
from rayexport.storage.store import Store

SHARD_FILE = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")
# Folders beside the shards holding config.json and tokenizer: Automodel's, then its merged copy.
NEARBY_HF_DIRS = (".hf_metadata", "consolidated")


@dataclass(frozen=True)
class ShardedSafetensorsCheckpoint(Checkpoint):
    """A folder of sharded safetensors: each rank's files, what each file holds, each tensor's shape."""

    rank_files: tuple[tuple[str, ...], ...] = ()  # by rank (shard index - 1)
    pieces: dict[str, dict[str, Piece]] = field(default_factory=dict)  # file -> tensor key -> piece
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tensor key -> full shape

    def known_keys(self) -> list[str]:
        """The tensor keys the headers list."""
        return list(self.shapes)

    def read_files(self) -> dict[str, int]:
        """Every rank's files, with their sizes."""
        return {name: self.store.size(name) for files in self.rank_files for name in files}

    def share(
        self, num_workers: int, aliases: dict[str, str], load: LoadStep, file_readers: dict[str, int] | None = None
    ) -> Loaded:
        """Each worker reads whole ranks (all of a rank's files, so tied copies in two of them
        are compared where read), in contiguous blocks, or where `file_readers` places a rank's
        first file."""
        if file_readers is None:
            worker_of_rank = assign_ranks(list(range(self.world_size)), num_workers)
        else:
            worker_of_rank = {rank: file_readers[files[0]] for rank, files in enumerate(self.rank_files)}
        return load_ranks(load, worker_of_rank)

    def part_bytes(self, part: list[int]) -> int:
        """The bytes of the files of the ranks `part`."""
        return sum(self.store.size(name) for rank in part for name in self.rank_files[rank])

    def describe_part(self, part: list[int]) -> dict[int, dict[str, ShardInfo]]:
        """Each rank's pieces, placed from the headers read when the checkpoint was described."""
        return {rank: {key: self.shard_info(name, key) for name in self.rank_files[rank] for key in self.pieces[name]} for rank in part}

    def shard_info(self, name: str, key: str) -> ShardInfo:
        """Where the piece of `key` in the file `name` sits in its tensor."""
        piece = self.pieces[name][key]
        return ShardInfo(local_shape=piece.shape, dtype=piece.dtype, global_shape=self.shapes[key], offset=piece.offset)

    def read(self, part: list[int], spool_dir: str, spooled: Advance) -> dict[int, SourceTensors]:
        """The files of the ranks `part`, memory-mapped (remote ones spooled to local disk first)."""
        states: dict[int, SourceTensors] = {}
        for rank in part:
            paths = {name: local_file(self.store, name, spool_dir, spooled) for name in self.rank_files[rank]}
            states[rank] = ShardFiles(self, paths)
        return states


class ShardFiles(SafetensorsFiles):
    """One rank's safetensors files, memory-mapped by safetensors: its pieces by tensor key."""

    def __init__(self, checkpoint: ShardedSafetensorsCheckpoint, paths: dict[str, str]) -> None:
        from safetensors import safe_open

        self.checkpoint, self.paths = checkpoint, paths
        self.handles, self.file_of = {}, {}
        for name, path in paths.items():
            where = checkpoint.store.display(name)
            try:
                handle = safe_open(path, framework="pt")
                entries = {key: (handle.get_slice(key).get_shape(), handle.get_slice(key).get_dtype()) for key in handle.keys()}
            except Exception as error:  # noqa: BLE001 - safetensors raises its own types
                raise ExportError(f"'{where}' cannot be read: {one_line(error)}") from None
            if header_pieces(entries, handle.metadata(), where) != checkpoint.pieces[name]:
                raise ExportError(f"'{where}' changed since it was listed")
            self.handles[name] = handle
            self.file_of.update(dict.fromkeys(entries, name))

    def describe(self, advance: Advance = lambda count: None) -> dict[str, ShardInfo]:
        """Each piece, placed in its tensor by the offset its header records."""
        infos = {}
        for key, name in self.file_of.items():
            infos[key] = self.checkpoint.shard_info(name, key)
            advance(self[key].nbytes)
        return infos

    def mapped_ranges(self) -> list[tuple[int, int]]:
        return [span for path in self.paths.values() for span in mapped_ranges(path)]


class ShardedSafetensorsLayout:
    """torch's sharded HF safetensors (torchtitan's `sharded/`, NeMo Automodel, NeMo-RL)."""

    name = "hf-sharded"

    def detect(self, store: Store, names: list[str]) -> bool:
        return any(SHARD_FILE.match(name) for name in names)

    def describe(self, store: Store, settings: SourceSettings) -> ShardedSafetensorsCheckpoint:
        return find_sharded_checkpoint(store)

    def snapshot(self, store: Store, names: list[str]) -> dict[str, int] | None:
        # The writer leaves no marker of its own. Once every rank's files are complete, torch's
        # consolidation (torchtitan's too) writes the merged index into the parent, Automodel's
        # into `consolidated/`, and Automodel writes `config.yaml` into the step folder last.
        from torch.distributed.checkpoint._hf_utils import _metadata_fn  # where it is used: see dcp_metadata

        parent = store.parent() or store
        if not (parent.exists(_metadata_fn) or store.exists(f"consolidated/{_metadata_fn}") or parent.exists("config.yaml")):
            return None
        return {name: store.size(name) for name in names}


def find_sharded_checkpoint(store: Store) -> ShardedSafetensorsCheckpoint:
    """Describe the sharded safetensors at `store` from their headers, or raise naming the
    missing rank file, or the tensor whose pieces do not cover it exactly once."""
    if not store.exists():
        raise ExportError(f"source '{store.uri}' does not exist")
    by_rank: dict[int, list[str]] = {}
    counts = set()
    for name in store.list():
        match = SHARD_FILE.match(name)
        if match:
            by_rank.setdefault(int(match.group(1)), []).append(name)
            counts.add(int(match.group(3)))
    if not by_rank:
        raise ExportError(f"no sharded safetensors files shard-*-model-*-of-*.safetensors in '{store.uri}'")
    if len(counts) > 1:
        raise ExportError(f"sharded safetensors of several saves (files of {', '.join(map(str, sorted(counts)))}) in '{store.uri}'")
    world_size = max(by_rank)
    missing = [shard for shard in range(1, world_size + 1) if shard not in by_rank]
    if missing and store.nowhere():
        plural = len(missing) > 1
        raise ExportError(
            f"rank file{'s' if plural else ''} of rank{'s' if plural else ''} {spans([shard - 1 for shard in missing])} "
            f"of world size {world_size} (shard-{missing[0]:05d}-*) {'are' if plural else 'is'} {store.nowhere()}"
        )
    if missing:
        from torch.distributed.checkpoint._hf_utils import _gen_file_name

        first_file = min(int(SHARD_FILE.match(name).group(2)) for names in by_rank.values() for name in names)
        raise ExportError(f"missing rank file '{store.display(_gen_file_name(first_file, counts.pop(), missing[0]))}'")
    rank_files = tuple(tuple(sorted(by_rank[shard])) for shard in range(1, world_size + 1))
    names = [name for files in rank_files for name in files]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        pieces = dict(zip(names, pool.map(lambda name: read_header(store, name), names)))
    by_key: dict[str, dict[str, Piece]] = {}
    for rank, files in enumerate(rank_files):
        held = [key for name in files for key in pieces[name]]
        if len(held) != len(set(held)):
            key = next(key for key in held if held.count(key) > 1)
            raise ExportError(f"tensor '{key}' is in two files of rank {rank} in '{store.uri}'")
        for name in files:
            for key, piece in pieces[name].items():
                by_key.setdefault(key, {})[name] = piece
    return ShardedSafetensorsCheckpoint(
        store=store, world_size=world_size, layout="hf-sharded",
        hf_folder=(store.parent() or store).child(HF_DIR),
        nearby_hf_folder=next((store.child(name) for name in NEARBY_HF_DIRS if store.exists(f"{name}/config.json")), None),
        rank_files=rank_files, pieces=pieces, shapes={key: full_shape(key, held) for key, held in by_key.items()},
    )
