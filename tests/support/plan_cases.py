"""Rank-file metadata for the planning tests: DTensor shards as FSDP2 lays them out, and the
expected model names and shapes."""

import math

import torch

from rayexport.plan.formats import IN_MEMORY, ON_DISK, ModelFormats, Naming
from rayexport.plan.naming import plan_holdings
from rayexport.plan.pieces import holders_by_key, holders_from_ranks
from rayexport.plan.shards import ShardInfo


def plan_tensors(rank_infos, expected, aliases, dtype=None, **kwargs):
    """Planning for rank files, as the exporter does it for a verl checkpoint, of a model whose
    two namings are the same (`expected`: name -> (shape, dtype); `aliases`: its ties)."""
    formats = ModelFormats.same(Naming(expected, aliases))
    return plan_holdings(holders_from_ranks(rank_infos), formats, IN_MEMORY, dtype, **kwargs)


EMBED, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
TIED = {HEAD: EMBED}


def chunk_sizes(rows, parts):
    """Rows per rank as torch.chunk (the rule FSDP2's Shard follows) splits them."""
    sizes = [len(chunk) for chunk in torch.arange(rows).chunk(parts)]
    return sizes + [0] * (parts - len(sizes))


def dtensor(global_shape, rank, world_size, dtype="float32", dim=0):
    """A rank's ShardInfo for a DTensor sharded along `dim` on a 1-D ("fsdp",) mesh."""
    local = list(global_shape)
    local[dim] = chunk_sizes(global_shape[dim], world_size)[rank]
    return ShardInfo(
        local_shape=tuple(local), dtype=dtype, global_shape=tuple(global_shape),
        placements=(f"S{dim}",), mesh_shape=(world_size,), mesh_ranks=tuple(range(world_size)),
        coordinate=(rank,),
    )


def extent_info(global_shape, placements, mesh_shape, coordinate):
    return ShardInfo(
        local_shape=(), dtype="float32", global_shape=tuple(global_shape), placements=tuple(placements),
        mesh_shape=tuple(mesh_shape), mesh_ranks=tuple(range(math.prod(mesh_shape))),
        coordinate=tuple(coordinate),
    )


def fsdp2_ranks(shapes, world_size, dtypes=None):
    """rank -> key -> ShardInfo for a checkpoint of DTensors sharded on dim 0."""
    dtypes = dtypes or {}
    return {
        rank: {key: dtensor(shape, rank, world_size, dtypes.get(key, "float32")) for key, shape in shapes.items()}
        for rank in range(world_size)
    }


def expected_of(shapes, dtypes=None):
    dtypes = dtypes or {}
    return {name: (tuple(shape), dtypes.get(name, "float32")) for name, shape in shapes.items()}


def piece_region(tensor, piece):
    """The part of a full tensor that `piece` covers (its offset and shape)."""
    return tensor[tuple(slice(start, start + length) for start, length in zip(piece.offset, piece.shape))]


def zero_partitions(state, world_size):
    """rank -> key -> (ShardInfo, local run) for `state` partitioned as ZeRO-1/2 partitions its
    flat buffer: every tensor flattened and concatenated in order, cut into `world_size` equal
    parts (the last one short), so that tensors straddle ranks."""
    flat = torch.cat([tensor.reshape(-1) for tensor in state.values()])
    size = -(-flat.numel() // world_size)
    ranks, position = {rank: {} for rank in range(world_size)}, 0
    for name, tensor in state.items():
        for rank in range(world_size):
            start, end = max(position, rank * size), min(position + tensor.numel(), (rank + 1) * size)
            if end > start:
                info = ShardInfo(local_shape=(end - start,), dtype="float32", global_shape=tuple(tensor.shape),
                                 offset=(start - position,), flat=True)
                ranks[rank][name] = (info, flat[start:end])
        position += tensor.numel()
    return ranks


def assembled(state, formats, world_size, output_format=ON_DISK, partition="fsdp2"):
    """The planning of `state` (source tensors by name, row-sharded over `world_size` FSDP2
    ranks, or with `partition="zero"` in ZeRO's runs, `zero_partitions`) and each output tensor
    assembled from the pieces it asks of each rank's shard, as the workers would send them."""
    from rayexport.plan.pieces import piece_tensor
    from rayexport.transport.assembly import assemble

    if partition == "zero":
        partitions = zero_partitions(state, world_size)
        holders = holders_by_key({rank: {key: info for key, (info, _) in held.items()} for rank, held in partitions.items()})
        shards = {key: {rank: partitions[rank][key][1] for rank in holders[key]} for key in holders}
    else:
        holders = holders_from_ranks(fsdp2_ranks({name: tuple(tensor.shape) for name, tensor in state.items()}, world_size))
        shards = {name: dict(enumerate(tensor.chunk(world_size))) for name, tensor in state.items()}
    planning = plan_holdings(holders, formats, output_format, None)
    tensors = {
        plan.name: assemble(plan, {piece: piece_tensor(shards[piece.source_key][piece.rank], piece) for piece in plan.pieces})
        for plan in planning.tensors
    }
    return planning, tensors
