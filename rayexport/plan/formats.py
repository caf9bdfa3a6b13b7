"""Formats: the two namings a model's tensors have had, and moving a plan from one to the other.

transformers 5 holds MoE experts fused and VLM submodules nested (its in-memory names, what a
checkpoint trained under it holds); `save_pretrained` writes the model's on-disk format (per
expert tensors, `model.*` + `visual.*`), which is also what transformers 4 held in memory. A
checkpoint is planned in whichever naming it was saved with and converted, as tiles of its
source pieces, to the format the export writes. A trainer that saves under names of its own
(torchtitan) adds a producer naming, converted to the on-disk format the same way. Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Literal, get_args

from rayexport.common.errors import ExportError
from rayexport.plan.pieces import Piece, is_run
from rayexport.plan.tiles import BoxIndex, Tile, invert, is_whole, select, select_runs

# The formats an export's tensors can be written in (`--format`), owned here: everything else
# compares with these names.
Format = Literal["on-disk", "in-memory"]
# What `save_pretrained` writes: per-expert MoE tensors, `model.*` + `visual.*` for VLMs (the
# Hub's layout, what vLLM and SGLang load, and what transformers 4 held in memory).
ON_DISK: Format = "on-disk"
# transformers 5's `state_dict()`: MoE experts fused, VLM submodules nested under `model.`.
IN_MEMORY: Format = "in-memory"
FORMATS: tuple[Format, ...] = get_args(Format)
# The most pieces one converted tensor is gathered in: a cut of runs (ZeRO) into more is refused,
# as each piece is a slice a worker sends and the exporter places.
MAX_PIECES = 65536

Shapes = dict[str, tuple[tuple[int, ...], str]]


@dataclass(frozen=True)
class Naming:
    """One naming of a model's tensors: each name (tied aliases included) with its shape and
    dtype, and each tied alias's canonical name."""

    expected: Shapes
    aliases: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ProducerNaming:
    """A trainer's own naming of a model's tensors, and each on-disk tensor as tiles of its
    tensors (what the trainer's own conversion to Hugging Face names makes). `beyond_model`: the
    on-disk tensors it also holds that the model's class has none of (shape, dtype), which the
    Hugging Face checkpoints of the model carry for other consumers (multi-token-prediction layers,
    which vLLM and SGLang load for speculative decoding)."""

    naming: Naming
    disk_tiles: dict[str, tuple[Tile, ...]]
    beyond_model: Shapes = field(default_factory=dict)


@dataclass(frozen=True)
class ModelFormats:
    """A model's in-memory and on-disk namings, the tiles of in-memory tensors each on-disk
    tensor is made of, which in-memory tensors are saved whole under another name, and the
    namings of the trainer that wrote the checkpoint, where it has names of its own."""

    memory: Naming
    disk: Naming
    disk_tiles: dict[str, tuple[Tile, ...]]
    renamed: dict[str, str]
    producers: dict[str, ProducerNaming] = field(default_factory=dict)

    @classmethod
    def from_tiles(cls, memory: Naming, disk: dict[str, tuple[tuple[int, ...], str, tuple[Tile, ...]]]) -> "ModelFormats":
        """Both namings from the in-memory one and each on-disk name's (shape, dtype, tiles)."""
        def saved_whole(shape: tuple[int, ...], tiles: tuple[Tile, ...]) -> bool:
            return bool(tiles) and is_whole(tiles, shape, memory.expected[tiles[0].source][0])

        if all(saved_whole(shape, tiles) and tiles[0].source == name for name, (shape, _, tiles) in disk.items()):
            return cls.same(memory)
        renamed = {tiles[0].source: name for name, (shape, _, tiles) in disk.items() if saved_whole(shape, tiles)}
        aliases = {
            renamed[alias]: renamed[canonical] for alias, canonical in memory.aliases.items()
            if alias in renamed and canonical in renamed
        }
        return cls(
            memory=memory,
            disk=Naming({name: (shape, dtype) for name, (shape, dtype, _) in disk.items()}, aliases),
            disk_tiles={name: tiles for name, (_, _, tiles) in disk.items()},
            renamed=renamed,
        )

    @classmethod
    def same(cls, memory: Naming) -> "ModelFormats":
        """A model whose on-disk format is its in-memory naming."""
        return cls(memory, memory, {}, {name: name for name in memory.expected})

    def tie_aliases(self) -> dict[str, str]:
        """Each tied alias of every naming, with its canonical name: which copies a checkpoint
        holding both must have read together, whatever naming it is in."""
        namings = [self.memory, self.disk, *(producer.naming for producer in self.producers.values())]
        return {alias: canonical for naming in namings for alias, canonical in naming.aliases.items()}

    def with_producers(self, producers: dict[str, ProducerNaming]) -> "ModelFormats":
        """These formats, a checkpoint in one of `producers`' namings read as well, and the
        tensors they hold beyond the model's class named on disk."""
        beyond = {name: shape for producer in producers.values() for name, shape in producer.beyond_model.items()}
        disk = replace(self.disk, expected={**self.disk.expected, **beyond}) if beyond else self.disk
        return replace(self, disk=disk, producers=producers)

    def beyond_model(self) -> frozenset[str]:
        """The on-disk tensors a producer holds beyond the model's class (`ProducerNaming.beyond_model`)."""
        return frozenset(name for producer in self.producers.values() for name in producer.beyond_model)

    def naming(self, kind: str) -> Naming:
        """The model's naming `kind`: a format, or a producer's naming."""
        if kind in self.producers:
            return self.producers[kind].naming
        return self.memory if kind == IN_MEMORY else self.disk

    def tiles(self, source: str, target: Format) -> dict[str, tuple[Tile, ...]] | None:
        """Each `target`-naming tensor as tiles of `source`-naming tensors (None: same names)."""
        if source in self.producers:
            if target == IN_MEMORY and self.disk_tiles:
                raise ExportError(
                    f"a checkpoint in {source} names is exported in the on-disk format only: this model's "
                    f"in-memory format differs (drop --format {IN_MEMORY})"
                )
            return self.producers[source].disk_tiles
        if source == target or not self.disk_tiles:
            return None
        if target == ON_DISK:
            return self.disk_tiles
        inverted: dict[str, list[Tile]] = {}
        for name, tiles in self.disk_tiles.items():
            for tile in tiles:
                inverted.setdefault(tile.source, []).append(invert(tile, name))
        return {name: tuple(tiles) for name, tiles in inverted.items()}

    def memory_name(self, kind: str, name: str) -> str | None:
        """The in-memory name of a tensor saved whole (None when it is split or merged, or
        named by a producer)."""
        if kind == IN_MEMORY:
            return name
        if kind in self.producers:
            return None
        return next((memory for memory, disk in self.renamed.items() if disk == name), None)


def choose_naming(names: Iterable[str], formats: ModelFormats) -> str:
    """The naming a checkpoint's (normalised) tensor names are in, decided from all of them:
    in-memory when every name is one (a dense model's two namings are the same), else on-disk.
    Names from both, with some in neither's overlap, are a mixture no conversion can read.
    Where the checkpoint's trainer has namings of its own, it is the one that has most names."""
    names = list(names)
    if formats.producers:
        return max(formats.producers, key=lambda kind: sum(name in formats.producers[kind].naming.expected for name in names))
    memory, disk = formats.memory.expected, formats.disk.expected
    if all(name in memory for name in names):
        return IN_MEMORY
    if all(name in disk for name in names):
        return ON_DISK
    only_memory = next((name for name in names if name in memory and name not in disk), None)
    only_disk = next((name for name in names if name in disk and name not in memory), None)
    if only_memory is not None and only_disk is not None:
        raise ExportError(
            f"the checkpoint mixes transformers' in-memory name '{only_memory}' with the on-disk name "
            f"'{only_disk}'; it fits neither naming of the config's model"
        )
    return ON_DISK if only_disk is not None else IN_MEMORY  # the name in neither is reported by the caller


def convert_plans(
    plans: list, tiles: dict[str, tuple[Tile, ...]] | None, target: Naming, source_kind: Format, target_kind: Format
) -> list:
    """The output tensors of `target` naming, each planned from the tiles of the source plans
    it is made of: every piece becomes the part of its shard a tile needs. A LoRA merge moves
    with a tensor that is only renamed; one split or merged is refused by name."""
    if tiles is None:
        return plans
    by_name = {plan.name: plan for plan in plans}
    converted, used = [], set()
    meeting = _MeetingPieces()
    for name, parts in tiles.items():
        sources = [by_name.get(tile.source) for tile in parts]
        if not any(sources):
            continue  # a tied alias the export drops
        if not all(sources):
            missing = next(tile.source for tile, plan in zip(parts, sources) if plan is None)
            raise ExportError(f"tensor '{name}' needs '{missing}', which the checkpoint does not provide")
        dtypes = {(plan.source_dtype, plan.dtype) for plan in sources}
        if len(dtypes) != 1:
            raise ExportError(f"tensor '{name}' would be made of tensors of different dtypes: {sorted(dtypes)}")
        shape = tuple(target.expected[name][0])
        first = sources[0]
        used.update(plan.name for plan in sources)
        if is_whole(parts, shape, first.shape):
            converted.append(replace(first, name=name))
            continue
        lora = next((plan for plan in sources if plan.lora is not None), None)
        if lora is not None:
            raise ExportError(
                f"LoRA on '{lora.name}' cannot be merged into '{name}', which the {source_kind} tensor is "
                f"split into or merged from; export with --format {source_kind} or --lora adapter"
            )
        pieces = tuple(
            converted_piece
            for tile, plan in zip(parts, sources)
            for piece in meeting(plan, tile)
            for converted_piece in _tile_pieces(tile, plan, piece, name, shape, source_kind)
        )
        if len(pieces) > MAX_PIECES:
            raise ExportError(
                f"tensor '{name}' would be gathered in {len(pieces)} pieces of its ranks' runs (at most {MAX_PIECES}); "
                f"export with --format {source_kind}"
            )
        converted.append(replace(first, name=name, shape=shape, pieces=pieces))
    unused = [plan.name for plan in plans if plan.name not in used]
    if unused:
        raise ExportError(f"tensor '{unused[0]}' has no place in the {target_kind} format")
    return converted


# A source tensor of more pieces than this is searched through a `BoxIndex` for each tile.
INDEXED_PIECES = 64


class _MeetingPieces:
    """The pieces of a source plan that a tile may take from: all of them, or for a tensor held
    in many boxes those its `BoxIndex` finds (ZeRO's runs of a flattened tensor, few, are all
    tried)."""

    def __init__(self) -> None:
        self.indexes: dict[str, BoxIndex | None] = {}

    def __call__(self, plan, tile: Tile) -> tuple[Piece, ...] | list[Piece]:
        if plan.name not in self.indexes:
            boxes = len(plan.pieces) > INDEXED_PIECES and not any(is_run(piece, plan.shape) for piece in plan.pieces)
            self.indexes[plan.name] = BoxIndex([(piece.offset, piece.shape) for piece in plan.pieces]) if boxes else None
        index = self.indexes[plan.name]
        return plan.pieces if index is None else [plan.pieces[position] for position in index.meeting(tile)]


def _tile_pieces(tile: Tile, plan, piece: Piece, name: str, shape: tuple[int, ...], source_kind: Format) -> list[Piece]:
    """The parts of one source piece that tile `tile` of output tensor `name` (of `shape`) takes:
    a box of a shard, or stretches of a run of the flattened tensor (ZeRO's partitions), each
    placed as a run of the flattened output."""
    if not is_run(piece, plan.shape):
        selection = select(tile, piece.offset, piece.shape)
        if selection is None:
            return []
        return [Piece(
            piece.rank, piece.source_key, selection.offset, selection.shape, piece.dtype, selection.region, selection.axes,
            tile.scale, tile.shift, selection.steps,
        )]
    try:
        runs = select_runs(tile, plan.shape, shape, piece.offset[0], piece.shape[0])
    except ValueError:
        raise ExportError(
            f"tensor '{plan.name}' is saved flattened across ranks and '{name}' is a transposed or strided cut of it; "
            f"export with --format {source_kind}"
        ) from None
    return [
        Piece(
            piece.rank, piece.source_key, (run.target_start,), (run.length,), piece.dtype, ((run.local_start, run.length, 1),),
            (0,), tile.scale, tile.shift,
        )
        for run in runs
    ]
