"""Where each piece of a tensor lives: which (pseudo-)ranks hold which slice of every source
tensor (torch's chunk rule for DTensor shards, dim-0 rows for plain FSDP1 shards), and which
ranks' files are needed at all (HSDP replicas are skipped). Pure functions over `ShardInfo`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rayexport.common.dtypes import nbytes
from rayexport.common.errors import ExportError

if TYPE_CHECKING:
    import torch

    from rayexport.plan.shards import ShardInfo

# The pseudo-rank of tensors the exporter reads from a base model folder (LoRA-only checkpoints).
BASE_MODEL_RANK = -1


@dataclass(frozen=True)
class Piece:
    """One rank's slice of one source tensor: where it sits in the output tensor. For a
    converted tensor (`plan/formats.py`) it is the box `region` (start, length, step per axis)
    of the rank's local shard, laid out along the output's axes (`axes`, as in `Tile`); otherwise the whole local shard.
    A piece with a one-element offset in a tensor of other than one dimension is a run of the
    flattened tensor (`is_run`), as DeepSpeed ZeRO partitions parameters. Its values are
    multiplied by `scale` and `shift` added as they are read, and land on every
    `placement_steps[i]`-th index of the output along axis i (a tile's, `rayexport.plan.tiles.Tile`)."""

    rank: int
    source_key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    region: tuple[tuple[int, int, int], ...] | None = None
    axes: tuple[int | None, ...] | None = None
    scale: float = 1.0
    shift: float = 0.0
    placement_steps: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


def piece_tensor(local: torch.Tensor, piece: Piece) -> torch.Tensor:
    """What `piece` takes from a rank's local shard: all of it, or for a converted tensor its
    region laid out along the output's axes; scaled and shifted as it says (in the tensor's own
    dtype, as the producer's converter computes)."""
    if piece.region is None:
        return _affine(local, piece)
    region = local[tuple(slice(start, start + length * step, step) for start, length, step in piece.region)]
    kept = [axis for axis in piece.axes if axis is not None]
    dropped = [axis for axis in range(region.dim()) if axis not in kept]  # unit extent
    return _affine(region.permute(kept + dropped).reshape(piece.shape), piece)


def _affine(values: torch.Tensor, piece: Piece) -> torch.Tensor:
    if piece.scale == 1 and not piece.shift:
        return values
    return values * piece.scale + piece.shift  # the shift after the scale: 0 x -1 + 0 is +0, not -0


def placed(piece: Piece) -> tuple[slice, ...]:
    """Where `piece` lands in its output tensor: a slice per axis."""
    steps = piece.placement_steps or (1,) * len(piece.offset)
    return tuple(slice(start, start + (length - 1) * step + 1, step) for start, length, step in zip(piece.offset, piece.shape, steps))


def is_run(piece: Piece, shape: tuple[int, ...]) -> bool:
    """Whether `piece` of a tensor of `shape` is a run of its flattened elements rather than a box."""
    return len(piece.offset) == 1 and len(shape) != 1


def holders_from_ranks(rank_infos: dict[int, dict[str, ShardInfo]]) -> dict[str, dict[int, ShardInfo]]:
    """Per key, what each rank holds; every rank file of one checkpoint must hold the same keys."""
    _check_same_keys(rank_infos)
    return holders_by_key(rank_infos)


def holders_by_key(rank_infos: dict[int, dict[str, ShardInfo]]) -> dict[str, dict[int, ShardInfo]]:
    """Per key, what each (pseudo-)rank holding part of it holds, ranks in order; ranks may hold
    different keys (a DCP file's chunks, a sharded safetensors rank's files)."""
    holders: dict[str, dict[int, ShardInfo]] = {}
    for rank, infos in sorted(rank_infos.items()):
        for key, info in infos.items():
            holders.setdefault(key, {})[rank] = info
    return holders


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


def tensor_pieces(key: str, infos: dict[int, ShardInfo], shape: tuple[int, ...]) -> tuple[Piece, ...]:
    """The pieces one source tensor is assembled from, whatever kind of tensor the ranks hold."""
    if all(info.flat for info in infos.values()):
        return run_pieces(key, infos, shape)
    is_dtensor = [info.global_shape is not None for info in infos.values()]
    if all(is_dtensor):
        return dtensor_pieces(key, infos, shape)
    if not any(is_dtensor):
        return plain_pieces(key, infos, shape)
    raise ExportError(f"tensor '{key}' is a DTensor in some rank files and plain in others")


def dtensor_pieces(
    key: str, infos: dict[int, ShardInfo], expected_shape: tuple[int, ...]
) -> tuple[Piece, ...]:
    """Pieces of a DTensor: one per rank that holds a first-replica shard (or, where the
    reader was told its offset, a DCP chunk: saved chunks are never replicas)."""
    pieces = []
    for rank in sorted(infos):
        info = infos[rank]
        if info.global_shape != expected_shape:
            raise ExportError(
                f"tensor '{key}' in rank {rank} has global shape {list(info.global_shape or ())}, "
                f"but the config's model expects {list(expected_shape)}"
            )
        extent = shard_extent(info, key, rank) if info.offset is None else (info.offset, info.local_shape)
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


def run_pieces(key: str, infos: dict[int, ShardInfo], expected_shape: tuple[int, ...]) -> tuple[Piece, ...]:
    """Pieces of a tensor saved as runs of its flattened elements (DeepSpeed ZeRO's partitions):
    each rank's run in order, which together must cover the tensor once."""
    for rank, info in sorted(infos.items()):
        if info.global_shape is not None and info.global_shape != expected_shape:
            raise ExportError(
                f"tensor '{key}' in rank {rank} has shape {list(info.global_shape)}, "
                f"but the config's model expects {list(expected_shape)}"
            )
    numel, position, pieces = math.prod(expected_shape), 0, []
    for start, length, rank in sorted((info.offset[0], info.local_shape[0], rank) for rank, info in infos.items()):
        if not length:
            continue
        if start != position:
            raise ExportError(
                f"tensor '{key}': rank {rank}'s part starts at element {start}, but the parts before end at {position}"
            )
        pieces.append(Piece(rank, key, (start,), (length,), infos[rank].dtype))
        position += length
    if position != numel:
        raise ExportError(f"tensor '{key}' parts cover {position} of its {numel} elements")
    if not pieces:  # an empty tensor still needs one (empty) piece to be assembled from
        first = min(infos)
        pieces.append(Piece(first, key, (0,), (0,), infos[first].dtype))
    return tuple(pieces)


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
