"""What a reader reports of each tensor a (pseudo-)rank holds, whatever the layout: its local
shape, dtype and DTensor placement (`ShardInfo`), read off the tensor without a process group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rayexport.common.dtypes import dtype_name
from rayexport.common.errors import ExportError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ShardInfo:
    """What one rank file holds for one key: enough to place its slice in the global tensor."""

    local_shape: tuple[int, ...]
    dtype: str
    global_shape: tuple[int, ...] | None = None  # None: a plain tensor, not a DTensor
    placements: tuple[str, ...] | None = None  # per mesh dim: "S<d>", "R", or "P"
    mesh_shape: tuple[int, ...] | None = None
    mesh_ranks: tuple[int, ...] | None = None  # the device mesh, flattened row-major
    coordinate: tuple[int, ...] | None = None
    # where the part starts in the global tensor, where the reader is told outright (a DCP chunk)
    offset: tuple[int, ...] | None = None
    # the part is a run of the flattened tensor (of `global_shape`), `local_shape` (n,) elements
    # from `offset` (start,): how DeepSpeed ZeRO partitions its flat buffers, across rows
    flat: bool = False


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """The part of a (D)Tensor this rank holds."""
    to_local = getattr(value, "to_local", None)
    return to_local() if to_local is not None else value


def describe_tensor(value: torch.Tensor, rank: int, meshes: dict[int, tuple] | None = None) -> ShardInfo:
    """The placement of one rank's (D)Tensor, without needing a process group. `meshes` keeps
    each device mesh's description by the mesh object, for the tensors of one file that share
    it (torch rebuilds a mesh's rank tensor each time it is asked for)."""
    local = local_tensor(value)
    dtype = dtype_name(local.dtype)
    mesh = getattr(value, "device_mesh", None)
    if mesh is None:
        return ShardInfo(local_shape=tuple(local.shape), dtype=dtype)
    meshes = {} if meshes is None else meshes
    if id(mesh) not in meshes:
        meshes[id(mesh)] = (mesh, _describe_mesh(mesh.mesh, rank))  # the mesh itself: its id stays its own
    mesh_shape, mesh_ranks, coordinate = meshes[id(mesh)][1]
    return ShardInfo(
        local_shape=tuple(local.shape),
        dtype=dtype,
        global_shape=tuple(value.shape),
        placements=tuple(_placement_code(placement) for placement in value.placements),
        mesh_shape=mesh_shape,
        mesh_ranks=mesh_ranks,
        coordinate=coordinate,
    )


def _describe_mesh(ranks: torch.Tensor, rank: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A device mesh's shape, its ranks flattened row-major, and `rank`'s coordinate in it."""
    positions = (ranks == rank).nonzero()
    if len(positions) != 1:
        raise ExportError(f"rank {rank} is not in the device mesh its own file records")
    return tuple(ranks.shape), tuple(int(member) for member in ranks.flatten()), tuple(int(index) for index in positions[0])


def _placement_code(placement) -> str:
    kind = type(placement).__name__
    if kind == "Shard":
        return f"S{placement.dim}"
    if kind == "Replicate":
        return "R"
    if kind == "Partial":
        return "P"
    return kind
