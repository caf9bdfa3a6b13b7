"""rayexport.plan.pieces: where each shard of a tensor lies (torch's chunk rule), and which
ranks' files are needed."""

import itertools
import math

import pytest
import torch

from rayexport.common.errors import ExportError
from rayexport.plan.pieces import is_run, needed_ranks, shard_extent, tensor_pieces
from rayexport.plan.shards import ShardInfo

from support.plan_cases import EMBED, NORM, extent_info, fsdp2_ranks


# --- shard_extent ---------------------------------------------------------------------------


def test_shard_extent_1000_rows_over_3_ranks():
    extents = [shard_extent(extent_info((1000, 8), ("S0",), (3,), (rank,)), "w", rank) for rank in range(3)]
    assert extents == [((0, 0), (334, 8)), ((334, 0), (334, 8)), ((668, 0), (332, 8))]
    chunks = torch.arange(1000).chunk(3)
    assert [shape[0] for _, shape in extents] == [len(chunk) for chunk in chunks]
    assert [offset[0] for offset, _ in extents] == [int(chunk[0]) for chunk in chunks]


def test_shard_extent_gives_an_empty_shard_to_a_rank_past_the_rows():
    shapes = [shard_extent(extent_info((2, 4), ("S0",), (3,), (rank,)), "w", rank)[1] for rank in range(3)]
    assert shapes == [(1, 4), (1, 4), (0, 4)]


@pytest.mark.parametrize("rows, parts", [(1, 4), (5, 4), (7, 3), (9, 3), (10, 4), (0, 2), (3, 8)])
def test_shard_extent_matches_torch_chunk(rows, parts):
    data = torch.arange(rows * 2).reshape(rows, 2)
    chunks = list(data.chunk(parts)) if rows else []
    for rank in range(parts):
        offset, shape = shard_extent(extent_info((rows, 2), ("S0",), (parts,), (rank,)), "w", rank)
        if rank < len(chunks):
            assert shape == tuple(chunks[rank].shape)
            assert torch.equal(data[offset[0]:offset[0] + shape[0]], chunks[rank])
        else:
            assert shape[0] == 0


def test_shard_extent_along_dim_1():
    extents = [shard_extent(extent_info((3, 10), ("S1",), (4,), (rank,)), "w", rank) for rank in range(4)]
    assert [shape for _, shape in extents] == [(3, 3), (3, 3), (3, 3), (3, 1)]
    assert [offset for offset, _ in extents] == [(0, 0), (0, 3), (0, 6), (0, 9)]


def test_shard_extent_replicate_on_nonzero_coordinate_is_skipped():
    assert shard_extent(extent_info((6, 2), ("R", "S0"), (2, 3), (1, 2)), "w", 5) is None
    assert shard_extent(extent_info((6, 2), ("R", "S0"), (2, 3), (0, 2)), "w", 2) == ((4, 0), (2, 2))
    assert shard_extent(extent_info((6, 2), ("R",), (2,), (0,)), "w", 0) == ((0, 0), (6, 2))


def test_shard_extent_rejects_partial():
    with pytest.raises(ExportError, match="Partial") as raised:
        shard_extent(extent_info((4,), ("P",), (2,), (0,)), "model.norm.weight", 0)
    assert "model.norm.weight" in str(raised.value)


def test_shard_extent_nested_sharding_chunks_what_the_previous_dim_left():
    # 10 rows over an outer mesh dim of 2 -> 5 + 5; each 5 over an inner dim of 3 -> 2, 2, 1
    extents = {
        coordinate: shard_extent(extent_info((10, 4), ("S0", "S0"), (2, 3), coordinate), "w", 0)
        for coordinate in itertools.product(range(2), range(3))
    }
    assert extents[(0, 0)] == ((0, 0), (2, 4))
    assert extents[(0, 2)] == ((4, 0), (1, 4))
    assert extents[(1, 0)] == ((5, 0), (2, 4))
    assert extents[(1, 2)] == ((9, 0), (1, 4))


@pytest.mark.parametrize(
    "global_shape, mesh_shape, placements",
    [
        ((10, 7), (2, 3), ("S0", "S0")),
        ((7, 3), (3, 2), ("S0", "S0")),
        ((10, 7), (2, 3), ("S0", "S1")),
        ((5, 9), (3, 2), ("S1", "S0")),
        ((5, 9), (2, 2), ("R", "S1")),
        ((3,), (4,), ("S0",)),
    ],
)
def test_shard_extent_matches_dtensor_layout(global_shape, mesh_shape, placements):
    """Compared with torch's own DTensor shard layout function."""
    utils = pytest.importorskip("torch.distributed.tensor._utils")
    compute = getattr(utils, "_compute_local_shape_and_global_offset", None)
    if compute is None:
        pytest.skip("this torch has no _compute_local_shape_and_global_offset")
    from torch.distributed.tensor import Replicate, Shard

    torch_placements = [Replicate() if code == "R" else Shard(int(code[1:])) for code in placements]
    for coordinate in itertools.product(*(range(size) for size in mesh_shape)):
        extent = shard_extent(extent_info(global_shape, placements, mesh_shape, coordinate), "w", 0)
        local_shape, global_offset = compute(global_shape, mesh_shape, list(coordinate), torch_placements)
        if extent is None:
            assert any(code == "R" and index for code, index in zip(placements, coordinate))
            continue
        offset, shape = extent
        assert shape == tuple(local_shape)
        if math.prod(shape):  # torch puts an empty shard's offset at the end; it is never read
            assert offset == tuple(global_offset)



# --- needed_ranks and assign_ranks ----------------------------------------------------------


def test_needed_ranks_hsdp_2x2_reads_the_first_replica():
    info = ShardInfo(
        local_shape=(5, 4), dtype="float32", global_shape=(10, 4), placements=("R", "S0"),
        mesh_shape=(2, 2), mesh_ranks=(0, 1, 2, 3), coordinate=(0, 0),
    )
    assert needed_ranks({EMBED: info, NORM: info}, 4) == [0, 1]


def test_needed_ranks_hsdp_follows_the_mesh_layout():
    """A mesh laid out as [[0, 2], [1, 3]]: the first "ddp" replica is ranks 0 and 2."""
    info = ShardInfo(
        local_shape=(5, 4), dtype="float32", global_shape=(10, 4), placements=("R", "S0"),
        mesh_shape=(2, 2), mesh_ranks=(0, 2, 1, 3), coordinate=(0, 0),
    )
    assert needed_ranks({EMBED: info}, 4) == [0, 2]


def test_needed_ranks_1d_mesh_reads_every_rank():
    assert needed_ranks(fsdp2_ranks({EMBED: (10, 4), NORM: (4,)}, 3)[0], 3) == [0, 1, 2]


def test_needed_ranks_plain_tensors_read_every_rank():
    assert needed_ranks({EMBED: ShardInfo((4, 4), "float32")}, 3) == [0, 1, 2]


def run_infos(runs: list[tuple[int, int]]) -> dict[int, ShardInfo]:
    """Ranks holding runs (start, length) of a flattened tensor, as ZeRO partitions it."""
    return {rank: ShardInfo(local_shape=(length,), dtype="float32", offset=(start,), flat=True)
            for rank, (start, length) in enumerate(runs)}


def test_runs_of_a_flattened_tensor_are_placed_in_order_across_rows():
    """ZeRO-3 gives each rank ceil(numel / world) elements of each parameter, cutting through
    rows: a (5, 3) weight over 4 ranks is runs of 4, 4, 4 and 3 (the last rank's padding dropped)."""
    pieces = tensor_pieces("w", run_infos([(8, 4), (0, 4), (12, 3), (4, 4)]), (5, 3))
    assert [(piece.rank, piece.offset, piece.shape) for piece in pieces] == [
        (1, (0,), (4,)), (3, (4,), (4,)), (0, (8,), (4,)), (2, (12,), (3,)),
    ]
    assert all(is_run(piece, (5, 3)) for piece in pieces)


@pytest.mark.parametrize("runs,message", [
    ([(0, 4), (5, 10)], "rank 1's part starts at element 5, but the parts before end at 4"),
    ([(0, 4), (4, 10)], "parts cover 14 of its 15 elements"),
])
def test_runs_that_leave_a_gap_or_fall_short_are_one_line(runs, message):
    with pytest.raises(ExportError, match=message):
        tensor_pieces("w", run_infos(runs), (5, 3))
