"""Planning: from what the rank files hold to output tensors, shard files and gather buckets.

Pure functions over metadata; no I/O, no Ray, no process groups.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from huggingface_hub import split_state_dict_into_shards_factory

from rayexport.dtypes import SAFETENSORS_DTYPES, SAFETENSORS_ORDER, dtype_of, nbytes
from rayexport.errors import ExportError
from rayexport.layouts.verl import ShardInfo
from rayexport.lora import (
    LoraSettings, LoraTarget, adapter_tensor_name, is_peft_checkpoint, lora_settings, split_peft_names,
)
from rayexport.names import normalize_key
from rayexport.ties import TieResolution, resolve_tied_names

# Packed buffers keep every piece at an offset that any dtype can be viewed at.
PACK_ALIGNMENT = 16
SAFETENSORS_NAME_PATTERN = "model{suffix}.safetensors"
# The pseudo-rank of tensors the exporter reads from a base model folder (LoRA-only checkpoints).
BASE_MODEL_RANK = -1


@dataclass(frozen=True)
class Piece:
    """One rank's slice of one source tensor: where it sits in the global tensor."""

    rank: int
    source_key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: its name, shape, dtypes, the pieces it is assembled from and, for a
    LoRA-adapted weight in merge mode, the adapter folded into it."""

    name: str
    source_key: str
    shape: tuple[int, ...]
    source_dtype: str
    dtype: str
    pieces: tuple[Piece, ...]
    lora: "LoraMerge | None" = None

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)

    @property
    def all_pieces(self) -> tuple[Piece, ...]:
        """Every piece this output needs gathered, adapter halves included."""
        if self.lora is None:
            return self.pieces
        return self.pieces + self.lora.a.pieces + self.lora.b.pieces


@dataclass(frozen=True)
class LoraMerge:
    """W + scale * B @ A, with A and B gathered alongside W."""

    a: TensorPlan
    b: TensorPlan
    scale: float


@dataclass(frozen=True)
class ShardFile:
    """One output safetensors file and its tensors, in the order they are written."""

    filename: str
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class Bucket:
    """Tensors gathered in one step by the worker that writes them; `sends[w]` are the pieces
    worker w packs, in order (the writer's own pieces never leave it)."""

    tensors: tuple[str, ...]
    sends: tuple[tuple[Piece, ...], ...]
    writer: int = 0


@dataclass(frozen=True)
class TransferPlan:
    """The whole gather: every bucket in the order all workers step through them, and the
    output files each writer streams (`files[w]`, in order)."""

    buckets: tuple[Bucket, ...]
    files: tuple[tuple[ShardFile, ...], ...]


def output_dtype(source_dtype: str, requested: str, config_dtype: str | None) -> str:
    """The dtype a tensor is written in: integers and bools are never cast."""
    if source_dtype not in SAFETENSORS_DTYPES:
        raise ExportError(f"dtype {source_dtype} cannot be written to safetensors")
    if not dtype_of(source_dtype).is_floating_point:
        return source_dtype
    if requested == "auto":
        return config_dtype or source_dtype
    return requested


def shard_extent(
    info: ShardInfo, key: str, rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offset, shape) of a DTensor's local shard in its global tensor, or None for a replica
    other than the first. Follows torch's rule: each mesh dim chunks what the previous left."""
    assert info.global_shape is not None and info.placements is not None
    offset = [0] * len(info.global_shape)
    shape = list(info.global_shape)
    for mesh_dim, placement in enumerate(info.placements):
        index, parts = info.coordinate[mesh_dim], info.mesh_shape[mesh_dim]
        if placement == "R":
            if index != 0:
                return None
        elif placement.startswith("S") and placement[1:].isdigit():
            dim = int(placement[1:])
            chunk = math.ceil(shape[dim] / parts) if shape[dim] else 0
            start = min(index * chunk, shape[dim])
            offset[dim] += start
            shape[dim] = max(0, min(chunk, shape[dim] - start))
        else:
            name = "Partial" if placement == "P" else placement
            raise ExportError(f"tensor '{key}' in rank {rank} has unsupported placement {name}")
    return tuple(offset), tuple(shape)


def plain_pieces(
    key: str, infos: dict[int, ShardInfo], expected_shape: tuple[int, ...]
) -> tuple[Piece, ...]:
    """Pieces of a plain (non-DTensor) tensor: replicated when every rank holds the full shape,
    else sharded along dim 0 in rank order (FSDP1 without a device mesh)."""
    ranks = sorted(infos)
    dtype = infos[ranks[0]].dtype
    if all(infos[rank].local_shape == expected_shape for rank in ranks):
        return (Piece(ranks[0], key, (0,) * len(expected_shape), expected_shape, dtype),)
    if expected_shape and all(
        infos[rank].local_shape[1:] == expected_shape[1:] for rank in ranks
    ) and sum(infos[rank].local_shape[0] for rank in ranks) == expected_shape[0]:
        pieces, row = [], 0
        for rank in ranks:
            shape = infos[rank].local_shape
            pieces.append(Piece(rank, key, (row,) + (0,) * (len(shape) - 1), shape, dtype))
            row += shape[0]
        return tuple(pieces)
    shapes = ", ".join(f"rank {rank}: {list(infos[rank].local_shape)}" for rank in ranks)
    raise ExportError(
        f"tensor '{key}' shards ({shapes}) do not add up to its shape {list(expected_shape)}"
    )


def dtensor_pieces(
    key: str, infos: dict[int, ShardInfo], expected_shape: tuple[int, ...]
) -> tuple[Piece, ...]:
    """Pieces of a DTensor: one per rank that holds a first-replica shard."""
    pieces = []
    for rank in sorted(infos):
        info = infos[rank]
        if info.global_shape != expected_shape:
            raise ExportError(
                f"tensor '{key}' in rank {rank} has global shape {list(info.global_shape or ())}, "
                f"but the config's model expects {list(expected_shape)}"
            )
        extent = shard_extent(info, key, rank)
        if extent is None:
            continue
        offset, shape = extent
        if shape != info.local_shape:
            raise ExportError(
                f"tensor '{key}' in rank {rank} holds shape {list(info.local_shape)}, but its "
                f"placement says {list(shape)}: rank files from different runs?"
            )
        if math.prod(shape):
            pieces.append(Piece(rank, key, offset, shape, info.dtype))
    covered = sum(math.prod(piece.shape) for piece in pieces)
    if covered != math.prod(expected_shape):
        raise ExportError(
            f"tensor '{key}' shards cover {covered} of its {math.prod(expected_shape)} elements"
        )
    if not pieces:  # an empty tensor still needs one (empty) piece to be assembled from
        first = min(infos)
        pieces.append(Piece(first, key, (0,) * len(expected_shape), expected_shape, infos[first].dtype))
    return tuple(pieces)


@dataclass(frozen=True)
class LoraRequest:
    """What to do with LoRA adapters: `mode` merge|adapter|both, settings from the checkpoint's
    `lora_train_meta.json` (`meta`) overridden by the user (`overrides`)."""

    mode: str = "merge"
    meta: dict | None = None
    overrides: dict = field(default_factory=dict)


@dataclass
class TensorPlanning:
    """Everything `plan_holdings` decides."""

    tensors: list[TensorPlan]
    adapters: list[TensorPlan]
    resolution: TieResolution
    tied_key_pairs: list[tuple[str, str]]
    lora: LoraSettings | None = None
    lora_targets: list[LoraTarget] = field(default_factory=list)


def holders_from_ranks(rank_infos: dict[int, dict[str, ShardInfo]]) -> dict[str, dict[int, ShardInfo]]:
    """Per key, what each rank holds; every rank file of one checkpoint must hold the same keys."""
    _check_same_keys(rank_infos)
    ranks = sorted(rank_infos)
    return {key: {rank: rank_infos[rank][key] for rank in ranks} for key in rank_infos[ranks[0]]}


def plan_holdings(
    holders: dict[str, dict[int, ShardInfo]],
    expected: dict[str, tuple[tuple[int, ...], str]],
    aliases: dict[str, str],
    requested_dtype: str,
    config_dtype: str | None,
    lora: LoraRequest | None = None,
    base_model: dict[str, ShardInfo] | None = None,
) -> TensorPlanning:
    """Match the checkpoint's keys to the model's names and plan how each tensor is assembled.

    `holders` maps each source key to the (pseudo-)ranks holding part of it: every rank file of
    a verl checkpoint (`holders_from_ranks`), or the one worker that read a whole DCP tensor.
    `expected` maps every state-dict name of the config's model (aliases included) to its shape
    and dtype; `aliases` maps tied alias names to their canonical names. PEFT names are mapped
    to the base model's, and LoRA adapters merged or planned as adapter tensors per `lora`.
    `base_model` describes the tensors of a base model folder, used for names the checkpoint
    lacks (LoRA-only checkpoints); the exporter reads those itself as `BASE_MODEL_RANK`.
    """
    lora = lora or LoraRequest()
    source_key_of: dict[str, str] = {}
    for key in holders:
        name = normalize_key(key)
        if name in source_key_of:
            raise ExportError(f"keys '{source_key_of[name]}' and '{key}' both name tensor '{name}'")
        source_key_of[name] = key
    if is_peft_checkpoint(source_key_of):
        model_names, targets = split_peft_names(source_key_of)
    else:
        model_names, targets = {name: name for name in source_key_of}, []
    checkpoint_key = {name: source_key_of[normalized] for name, normalized in model_names.items()}

    resolution = resolve_tied_names(checkpoint_key, aliases)
    wanted = [name for name in expected if name not in aliases]
    from_base = [name for name in wanted if name not in resolution.sources and name in (base_model or {})]
    missing = [name for name in wanted if name not in resolution.sources and name not in from_base]
    if missing:
        raise ExportError(
            f"the checkpoint has no tensor '{missing[0]}' that the config's model needs"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + ("" if base_model is not None else "; for a LoRA-only checkpoint pass --base-model")
        )
    unexpected = [name for name in resolution.sources if name not in expected]
    if unexpected:
        raise ExportError(
            f"the checkpoint's tensor '{checkpoint_key[resolution.sources[unexpected[0]]]}' is not "
            f"in the config's model" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )

    def plan_for(name: str, key: str, shape: tuple[int, ...], infos: dict[int, ShardInfo]) -> TensorPlan:
        dtypes = {info.dtype for info in infos.values()}
        if len(dtypes) != 1:
            raise ExportError(f"tensor '{key}' has different dtypes across ranks: {sorted(dtypes)}")
        source_dtype = dtypes.pop()
        return TensorPlan(
            name=name, source_key=key, shape=shape, source_dtype=source_dtype,
            dtype=output_dtype(source_dtype, requested_dtype, config_dtype),
            pieces=tensor_pieces(key, infos, shape),
        )

    plans = {}
    for name in wanted:
        shape = tuple(expected[name][0])
        if name in from_base:
            plans[name] = plan_for(name, name, shape, {BASE_MODEL_RANK: base_model[name]})
        else:
            key = checkpoint_key[resolution.sources[name]]
            plans[name] = plan_for(name, key, shape, holders[key])

    settings, adapters = None, []
    if targets:
        settings = lora_settings(lora.meta, _rows(holders[source_key_of[targets[0].a_name]]), lora.overrides)
        for target in targets:
            weight = f"{target.module}.weight"
            if weight not in plans:
                raise ExportError(f"LoRA module '{target.module}' has no base weight '{weight}'")
            out_features, in_features = plans[weight].shape
            halves = []
            for which, normalized, shape in (("A", target.a_name, (settings.r, in_features)),
                                             ("B", target.b_name, (out_features, settings.r))):
                key = source_key_of[normalized]
                halves.append(plan_for(adapter_tensor_name(target, which), key, shape, holders[key]))
            if lora.mode in ("merge", "both"):
                plans[weight] = replace(plans[weight], lora=LoraMerge(halves[0], halves[1], settings.scale))
            if lora.mode in ("adapter", "both"):
                adapters.extend(halves)
    tied_key_pairs = [(checkpoint_key[canonical], checkpoint_key[alias]) for canonical, alias in resolution.to_compare]
    return TensorPlanning(
        tensors=[plans[name] for name in wanted], adapters=adapters, resolution=resolution,
        tied_key_pairs=tied_key_pairs, lora=settings, lora_targets=targets,
    )


def tensor_pieces(key: str, infos: dict[int, ShardInfo], shape: tuple[int, ...]) -> tuple[Piece, ...]:
    """The pieces one source tensor is assembled from, whatever kind of tensor the ranks hold."""
    is_dtensor = [info.global_shape is not None for info in infos.values()]
    if all(is_dtensor):
        return dtensor_pieces(key, infos, shape)
    if not any(is_dtensor):
        return plain_pieces(key, infos, shape)
    raise ExportError(f"tensor '{key}' is a DTensor in some rank files and plain in others")


def _check_same_keys(rank_infos: dict[int, dict[str, ShardInfo]]) -> None:
    ranks = sorted(rank_infos)
    reference_keys = set(rank_infos[ranks[0]])
    for rank in ranks[1:]:
        keys = set(rank_infos[rank])
        if keys != reference_keys:
            key = sorted(keys ^ reference_keys)[0]
            holder = rank if key in keys else ranks[0]
            raise ExportError(
                f"rank files disagree: only rank {holder} of ranks {ranks[0]} and {rank} holds tensor '{key}'"
            )


def _rows(infos: dict[int, ShardInfo]) -> int:
    """The first dimension of a tensor spread over ranks (a LoRA A's rank r)."""
    first = next(iter(infos.values()))
    if first.global_shape is not None:
        return first.global_shape[0]
    shapes = {info.local_shape for info in infos.values()}
    return first.local_shape[0] if len(shapes) == 1 else sum(info.local_shape[0] for info in infos.values())


def safetensors_order(tensors: list[TensorPlan]) -> list[TensorPlan]:
    """The order `safetensors.torch.save` lays tensors out in a file: by the library's dtype
    order, last first, then by name; matching it makes a streamed shard byte-identical to a
    library save."""
    return sorted(tensors, key=lambda plan: (-SAFETENSORS_ORDER[plan.dtype], plan.name))


def plan_shard_files(tensors: list[TensorPlan], max_shard_size: int | str) -> list[ShardFile]:
    """Split the output into HF-convention files (huggingface_hub's greedy rule)."""
    by_name = {plan.name: plan for plan in tensors}
    split = split_state_dict_into_shards_factory(
        by_name,
        get_storage_size=lambda plan: plan.nbytes,
        filename_pattern=SAFETENSORS_NAME_PATTERN,
        max_shard_size=max_shard_size,
    )
    return [
        ShardFile(
            filename=filename,
            tensors=tuple(plan.name for plan in safetensors_order([by_name[n] for n in names])),
        )
        for filename, names in split.filename_to_tensors.items()
    ]


def keep_ties_together(keys_by_worker: list[list[str]], aliases: dict[str, str]) -> list[list[str]]:
    """Move each tied alias to the worker that reads its canonical tensor, so the two saved
    copies can be compared where they are read (DCP stores both)."""
    worker_of = {key: worker for worker, keys in enumerate(keys_by_worker) for key in keys}
    moved = [list(keys) for keys in keys_by_worker]
    for alias, canonical in aliases.items():
        if alias in worker_of and canonical in worker_of and worker_of[alias] != worker_of[canonical]:
            moved[worker_of[alias]].remove(alias)
            moved[worker_of[canonical]].append(alias)
    return moved


def assign_ranks(ranks: list[int], num_workers: int) -> dict[int, int]:
    """Spread the rank files to read over the workers in contiguous blocks; rank 0 stays on
    worker 0, the exporter, so its shards never cross the network."""
    ranks = sorted(ranks)
    per_worker = math.ceil(len(ranks) / num_workers)
    return {rank: position // per_worker for position, rank in enumerate(ranks)}


def plan_buckets(
    tensors_in_order: list[TensorPlan],
    worker_of_rank: dict[int, int],
    num_workers: int,
    bucket_size: int,
    writer: int = 0,
) -> list[Bucket]:
    """Group output tensors, in write order, into buckets of at most `bucket_size` gathered
    bytes (a larger tensor travels alone), each gathered to `writer` in one step."""
    groups: list[list[TensorPlan]] = []
    size = 0
    for plan in tensors_in_order:
        nbytes = sum(piece.nbytes for piece in plan.all_pieces)
        if not groups or (size + nbytes > bucket_size and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(plan)
        size += nbytes
    buckets = []
    for group in groups:
        sends: list[list[Piece]] = [[] for _ in range(num_workers)]
        for plan in group:
            for piece in plan.all_pieces:
                sends[worker_of_rank[piece.rank]].append(piece)
        buckets.append(
            Bucket(tensors=tuple(plan.name for plan in group), sends=tuple(map(tuple, sends)), writer=writer)
        )
    return buckets


def assign_writers(files: list[ShardFile], plans: dict[str, TensorPlan], writers: int) -> list[int]:
    """The writer of each output file: largest files first, each to the least-loaded writer
    (ties to the lowest index), so `writers` workers upload about equal bytes."""
    loads = [0] * writers
    writer_of = [0] * len(files)
    sizes = [sum(plans[name].nbytes for name in shard.tensors) for shard in files]
    for position in sorted(range(len(files)), key=lambda position: (-sizes[position], position)):
        writer = min(range(writers), key=lambda writer: (loads[writer], writer))
        writer_of[position] = writer
        loads[writer] += sizes[position]
    return writer_of


def plan_transfer(
    files: list[ShardFile],
    plans: dict[str, TensorPlan],
    worker_of_rank: dict[int, int],
    num_workers: int,
    bucket_size: int,
    writers: int = 1,
) -> TransferPlan:
    """Bucket each writer's files in write order, then interleave the writers' buckets so that
    while one writer uploads, the next bucket is already on its way to another."""
    writers = max(1, min(writers, num_workers, len(files) or 1))
    writer_of = assign_writers(files, plans, writers)
    files_of = [tuple(shard for shard, owner in zip(files, writer_of) if owner == writer) for writer in range(writers)]
    queues = [
        plan_buckets(
            [plans[name] for shard in files_of[writer] for name in shard.tensors],
            worker_of_rank, num_workers, bucket_size, writer,
        )
        for writer in range(writers)
    ]
    interleaved = [bucket for round_ in itertools.zip_longest(*queues) for bucket in round_ if bucket is not None]
    return TransferPlan(tuple(interleaved), tuple(files_of) + ((),) * (num_workers - writers))


def packed_offsets(pieces: tuple[Piece, ...]) -> tuple[list[int], int]:
    """Byte offset of each piece in a packed buffer, and the buffer's size."""
    offsets, position = [], 0
    for piece in pieces:
        offsets.append(position)
        position += -(-piece.nbytes // PACK_ALIGNMENT) * PACK_ALIGNMENT
    return offsets, position


def needed_ranks(rank_zero: dict[str, ShardInfo], world_size: int) -> list[int]:
    """Ranks whose files hold data not found elsewhere, judged from rank 0's file: with HSDP
    only the first replica along each replicated mesh dim is read."""
    dtensor_infos = [info for info in rank_zero.values() if info.global_shape is not None]
    if not dtensor_infos:
        return list(range(world_size))
    mesh_shape, mesh_ranks = dtensor_infos[0].mesh_shape, dtensor_infos[0].mesh_ranks
    needed = set(range(world_size)) - set(mesh_ranks)
    for position, rank in enumerate(mesh_ranks):
        coordinate = _unravel(position, mesh_shape)
        if any(
            all(coordinate[dim] == 0 for dim, code in enumerate(info.placements) if code == "R")
            for info in dtensor_infos
        ):
            needed.add(rank)
    return sorted(needed)


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coordinate = []
    for size in reversed(shape):
        coordinate.append(index % size)
        index //= size
    return tuple(reversed(coordinate))
