"""What every checkpoint layout provides (the `Layout` protocol) and what a described checkpoint
offers the rest of the export (the `Checkpoint` protocol), so that `job`, `group`, `workers`,
`model` and `watch` read any layout the same way. A new layout is one module implementing both,
plus one line in `rayexport.layouts.registry`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from rayexport.common.errors import ExportError
from rayexport.layouts.mapped import mapped_ranges
from rayexport.plan.pieces import Piece, holders_by_key, piece_tensor
from rayexport.plan.shards import ShardInfo, local_tensor
from rayexport.storage.store import Store

# The folder beside the weights where trainers (verl, DCP loops) put config, tokenizer and code.
HF_DIR = "huggingface"
# What one worker is asked to read: a layout's own description of its share (rank numbers,
# tensor keys, ...), opaque to everything but that layout.
Part = Any
# One distributed step: each worker given a part reads it; returns what each (pseudo-)rank holds.
LoadStep = Callable[[dict[int, Part]], dict[int, dict[str, ShardInfo]]]
# Called as a worker goes through its share: bytes described so far (for its bar), and the
# moment to give back the pages it has read.
Advance = Callable[[int], Any]
# A trainer's own namings of a model, for a checkpoint it saved under names of its own: from
# config.json and the model's on-disk `plan.formats.Naming`, each naming by name as a
# `plan.formats.ProducerNaming` (what its conversion to Hugging Face names makes of each tensor).
ProducerNamings = Callable[[dict, Any], dict[str, Any]]


@dataclass(frozen=True)
class KeyMapping:
    """How a layout's stored keys become the checkpoint's keys: a stored key under `prefix`
    names the key after it (None: not a model tensor). Names of a trainer's own are mapped to
    the model's when planning (`Checkpoint.producer_namings`), not here."""

    prefix: str = ""

    def model_key(self, stored_key: str) -> str | None:
        """The model key of `stored_key`, or None when it is not under the prefix."""
        if not stored_key.startswith(self.prefix):
            return None
        return stored_key[len(self.prefix):] or None


class SourceTensors(Mapping):
    """The tensors one (pseudo-)rank holds, by key, read only when touched."""

    fetches = False  # whether `values` fetches from object storage (worth asking for several at once)

    def describe(self, advance: Advance = lambda count: None) -> dict[str, ShardInfo]:
        """Every tensor's placement and finiteness, calling `advance` after each one."""
        raise NotImplementedError

    def mapped_ranges(self) -> list[tuple[int, int]]:
        """The address ranges of the files these tensors map, for `release_pages`."""
        return []

    def values(self, piece: Piece) -> Any:
        """What `piece` (of one of these tensors) takes from it: a view of the tensor held here;
        a reader of object storage may fetch just those bytes instead."""
        return piece_tensor(local_tensor(self[piece.source_key]), piece)


class MappedTensors(SourceTensors):
    """Tensors by key that are views of one memory-mapped file at `path` (None: it holds none)."""

    def __init__(self, tensors: dict[str, Any], path: str | None) -> None:
        self.tensors, self.path = tensors, path

    def __getitem__(self, key: str) -> Any:
        return self.tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def mapped_ranges(self) -> list[tuple[int, int]]:
        return mapped_ranges(self.path) if self.path else []


@dataclass
class Loaded:
    """A checkpoint spread over the workers: what each (pseudo-)rank holds, the same per key,
    and the worker holding each rank."""

    rank_infos: dict[int, dict[str, ShardInfo]]
    holders: dict[str, dict[int, ShardInfo]]
    worker_of_rank: dict[int, int]


@dataclass(frozen=True)
class SourceSettings:
    """The user's say in how a source is read: the stored keys' model prefix (None: detected,
    where the layout nests state dicts), whether pickles may run code (trusted input only), and
    which of a save folder's iterations to read (None: the newest its trainer recorded), and which
    tag folder of a DeepSpeed save (None: the one its `latest` names)."""

    key_prefix: str | None = None
    unsafe_pickle: bool = False
    step: int | None = None
    tag: str | None = None


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as a layout found it: the facts every layout records (layouts add fields of
    their own), how it is spread over the workers and how a worker reads its part."""

    store: Store  # the folder the checkpoint's files are in
    world_size: int
    layout: str  # the name the report and the manifest give it, e.g. "verl-fsdp2"
    hf_folder: Store | None = None  # where its trainer puts config and tokenizer (`huggingface/`), if anywhere
    # config/tokenizer beside the checkpoint (a Trainer folder), used after --hf-config
    nearby_hf_folder: Store | None = None
    lora_meta: dict | None = None
    skipped: list[str] = field(default_factory=list)  # stored entries that are not model tensors
    # where the trainer saved under names of its own (torchtitan), its namings of the model
    producer_namings: ProducerNamings | None = None
    # the trainer's own files and folders in `hf_folder` (a save folder beside its weights): not carried
    trainer_files: frozenset[str] = frozenset()
    spools_remote_files = True  # whether a worker copies a remote file to local disk to read it

    @property
    def uri(self) -> str:
        return self.store.uri

    def known_keys(self) -> list[str] | None:
        """Every tensor key the workers will report, where the layout knows them before reading
        (DCP's `.metadata`), so names are checked before any worker starts; None: only reading tells."""
        return None

    def read_files(self) -> dict[str, int]:
        """The files its workers read, by name under `store`, with their sizes. Where the
        store's files are spread over the cluster's nodes (`Store.holders`), the workers are
        placed by them, each file read whole on a node that holds it."""
        raise NotImplementedError

    def share(
        self, num_workers: int, aliases: dict[str, str], load: LoadStep, file_readers: dict[str, int] | None = None
    ) -> Loaded:
        """Spread the checkpoint over `num_workers` workers with as many `load` steps as the
        layout needs; `aliases` (tied names, model name -> canonical) must land together.
        `file_readers`: the worker that must read each of `read_files()` (on a node that holds
        it), worker 0 the first; None: any worker reads any file."""
        raise NotImplementedError

    def part_bytes(self, part: Part) -> int:
        """The bytes a worker reads for `part`."""
        raise NotImplementedError

    def read(self, part: Part, spool_dir: str, spooled: Advance) -> dict[int, SourceTensors]:
        """In a worker: read `part`, spooling remote files under `spool_dir` (`spooled` gets
        each count of bytes spooled); the tensors per (pseudo-)rank."""
        raise NotImplementedError

    def describe_part(self, part: Part) -> dict[int, dict[str, ShardInfo]]:
        """What a worker reading `part` reports of each (pseudo-)rank's tensors, without their
        values (`--dry-run`). By default `part` is opened as a worker opens it, memory-mapped, so
        that only the records placing each tensor are read: that needs the files where this
        process sees them. A layout whose metadata places every tensor overrides it."""
        if not self.store.is_local:
            where = "would have to fetch whole: run it on a local or mounted copy"
        elif self.store.nowhere() is not None:
            where = "holds on the cluster's nodes' own disks: run it where one folder holds them all"
        else:
            where = None
        if where is not None:
            raise ExportError(
                f"--dry-run reads only metadata, and a {self.layout} checkpoint records its tensors' shapes inside "
                f"its files, which '{self.uri}' {where}"
            )
        return {rank: tensors.describe() for rank, tensors in self.read(part, "", lambda count: None).items()}


class Layout(Protocol):
    """One way trainers lay checkpoints out on storage."""

    name: str  # what --layout calls it

    def detect(self, store: Store, names: list[str]) -> bool:
        """Whether the folder `store`, whose files are `names`, holds a checkpoint of this layout."""

    def describe(self, store: Store, settings: SourceSettings) -> Checkpoint:
        """The checkpoint at `store`, or ExportError naming what is missing or inconsistent."""

    def snapshot(self, store: Store, names: list[str]) -> dict[str, int] | None:
        """The names and sizes of the checkpoint's files, for the watcher to see them settle;
        None while the trainer has not written its completion marker yet."""


def load_ranks(load: LoadStep, worker_of_rank: dict[int, int]) -> Loaded:
    """One `load` step in which each worker reads its ranks (as `Part`s, lists of rank numbers)."""
    rank_infos = load(rank_parts(worker_of_rank))
    return Loaded(rank_infos, holders_by_key(rank_infos), worker_of_rank)


def count_part_bytes(totals: dict[int, int], checkpoint: Checkpoint, parts: dict[int, Part]) -> None:
    """Add to `totals` the bytes each worker is given to read in one load step (its `parts`)."""
    for worker, part in parts.items():
        totals[worker] = totals.get(worker, 0) + checkpoint.part_bytes(part)


def rank_parts(worker_of_rank: dict[int, int]) -> dict[int, list[int]]:
    """Each worker's ranks, in order (its `Part`), from the worker of each rank."""
    parts: dict[int, list[int]] = {}
    for rank, worker in sorted(worker_of_rank.items()):
        parts.setdefault(worker, []).append(rank)
    return parts


def marker_snapshot(store: Store, names: list[str], marker: str) -> dict[str, int] | None:
    """A `Layout.snapshot` for a layout whose trainer writes `marker` last, beside the files."""
    if marker not in names:
        return None
    return {name: store.size(name) for name in names}
