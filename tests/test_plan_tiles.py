"""Tiles against torch itself: a tensor rebuilt from its tiles, through the same shard
selection a worker makes, equals what the torch ops produce."""

from dataclasses import replace

import torch

import pytest

from rayexport.plan.pieces import Piece, piece_tensor, placed
from rayexport.plan.tiles import (
    BoxIndex, Tile, concatenate, drop_axis, insert_axis, invert, is_whole, narrow, permute, select, select_runs, whole,
)


def rebuild(tiles, sources, shape, shards=None):
    """The target from its tiles, each taken from source shards (default: whole sources) as a
    worker does (`select`, then `piece_tensor`)."""
    target = torch.full(shape, float("nan"))
    for tile in tiles:
        source = sources[tile.source]
        for offset, part in (shards or {}).get(tile.source, [((0,) * source.dim(), source)]):
            selection = select(tile, offset, tuple(part.shape))
            if selection is None:
                continue
            piece = Piece(0, tile.source, selection.offset, selection.shape, "float32", selection.region, selection.axes,
                          placement_steps=selection.steps)
            target[placed(piece)] = piece_tensor(part, piece)
    return target


def test_an_expert_split_out_of_a_fused_tensor_is_its_box():
    fused = torch.randn(4, 6, 5)  # [experts, 2 * intermediate, hidden]
    tiles = (whole("fused", (4, 6, 5)),)
    up = narrow(tiles, 1, 3, 3)  # chunk: the second half of dim 1
    expert = drop_axis(narrow(up, 0, 2, 1), 0)  # unbind: expert 2
    assert [(tile.source_offset, tile.source_shape) for tile in expert] == [((2, 3, 0), (1, 3, 5))]
    torch.testing.assert_close(rebuild(expert, {"fused": fused}, (3, 5)), fused[2, 3:6])


def test_a_fused_tensor_sharded_on_experts_takes_each_expert_from_its_rank():
    fused = torch.randn(4, 6, 5)
    shards = {"fused": [((0, 0, 0), fused[:2]), ((2, 0, 0), fused[2:])]}  # FSDP Shard(0) over 2 ranks
    expert = drop_axis(narrow(narrow((whole("fused", (4, 6, 5)),), 1, 0, 3), 0, 3, 1), 0)
    selections = [select(expert[0], offset, tuple(part.shape)) for offset, part in shards["fused"]]
    assert selections[0] is None and selections[1].region == ((1, 1, 1), (0, 3, 1), (0, 5, 1))  # whole expert, rank 1
    torch.testing.assert_close(rebuild(expert, {"fused": fused}, (3, 5), shards), fused[3, :3])


def test_shards_that_cut_through_a_box_are_each_sent_their_part():
    weight = torch.randn(7, 4)
    shards = {"w": [((0, 0), weight[:, :2]), ((0, 2), weight[:, 2:])]}  # sharded on dim 1
    tiles = permute(narrow((whole("w", (7, 4)),), 0, 2, 4), (1, 0))
    torch.testing.assert_close(rebuild(tiles, {"w": weight}, (4, 4), shards), weight[2:6].T)


def test_stacked_and_concatenated_experts_round_trip_through_invert():
    gates = {f"g{i}": torch.randn(3, 5) for i in range(2)}
    ups = {f"u{i}": torch.randn(3, 5) for i in range(2)}
    stack = lambda names: concatenate([(insert_axis((whole(name, (3, 5)),), 0), 1) for name in names], 0)  # noqa: E731
    fused = concatenate([(stack(["g0", "g1"]), 3), (stack(["u0", "u1"]), 3)], 1)
    sources = {**gates, **ups}
    expected = torch.cat([torch.stack([gates["g0"], gates["g1"]]), torch.stack([ups["u0"], ups["u1"]])], 1)
    torch.testing.assert_close(rebuild(fused, sources, (2, 6, 5)), expected)
    for name, tensor in sources.items():  # each source back out of the fused tensor
        back = tuple(invert(tile, "fused") for tile in fused if tile.source == name)
        torch.testing.assert_close(rebuild(back, {"fused": expected}, (3, 5)), tensor)


def test_a_rename_is_whole_and_a_slice_is_not():
    assert is_whole((whole("a", (2, 3)),), (2, 3), (2, 3))
    assert not is_whole(narrow((whole("a", (2, 3)),), 0, 0, 1), (1, 3), (2, 3))  # the first row only


def interleaved_rows(heads: int, head_dim: int, columns: int) -> tuple:
    """torchtitan's Llama q/k reordering as strided tiles: per head h and half s, target rows
    h*hd + s*hd/2 + j are source rows h*hd + 2*j + s."""
    half = head_dim // 2
    return tuple(
        replace(whole("q", (half, columns)), offset=(h * head_dim + s * half, 0), source_offset=(h * head_dim + s, 0), steps=(2, 1))
        for h in range(heads) for s in (0, 1)
    )


def test_strided_tiles_interleave_rows_through_shards_that_cut_heads():
    heads, head_dim, columns = 3, 8, 5
    q = torch.randn(heads * head_dim, columns)
    expected = q.view(heads, head_dim // 2, 2, columns).transpose(1, 2).reshape(heads * head_dim, columns)
    tiles = interleaved_rows(heads, head_dim, columns)
    # uneven row shards, cutting heads and pairs of rows: 7, 10 and 7 rows
    shards = {"q": [((0, 0), q[:7]), ((7, 0), q[7:17]), ((17, 0), q[17:])]}
    assert torch.equal(rebuild(tiles, {"q": q}, tuple(q.shape), shards), expected)
    narrowed = narrow(tiles, 0, 5, 9)  # the target's rows 5..13, as a tile of a split would take them
    assert torch.equal(rebuild(narrowed, {"q": q}, (9, columns), shards), expected[5:14])


def test_columns_interleaved_in_the_target_land_on_every_other_column_through_shards():
    """gpt-oss's gate_up_proj: the gate and up halves of each expert's rows, transposed, land on
    the even and odd columns of the target; shards that cut experts and rows send their parts to
    their places."""
    experts, rows, hidden = 3, 4, 5
    fc1 = torch.randn(experts, 2 * rows, hidden)
    expected = torch.stack([fc1[:, :rows], fc1[:, rows:]], dim=-1).transpose(1, 2).reshape(experts, hidden, 2 * rows)
    tiles = tuple(
        Tile("fc1", (0, 0, part), (experts, hidden, rows), (0, part * rows, 0), (0, 2, 1), target_steps=(1, 1, 2))
        for part in (0, 1)
    )
    shards = {"fc1": [((0, 0, 0), fc1[:2, :3]), ((0, 3, 0), fc1[:2, 3:]), ((2, 0, 0), fc1[2:])]}
    assert torch.equal(rebuild(tiles, {"fc1": fc1}, tuple(expected.shape), shards), expected)
    with pytest.raises(ValueError, match="interleaved in its target cannot be moved further"):
        narrow(tiles, 0, 0, 1)


def rebuild_from_runs(tiles, sources, shape, runs):
    """The target from its tiles, each cut from runs ((start, length) each) of its flattened
    source as a worker sends them (`select_runs`, then `piece_tensor` of the 1-D run)."""
    target = torch.full(shape, float("nan"))
    for tile in tiles:
        source = sources[tile.source]
        for start, length in runs:
            for run in select_runs(tile, tuple(source.shape), shape, start, length):
                piece = Piece(0, tile.source, (run.target_start,), (run.length,), "float32", ((run.local_start, run.length, 1),), (0,))
                local = source.reshape(-1)[start:start + length]
                target.view(-1)[run.target_start:run.target_start + run.length] = piece_tensor(local, piece)
    return target


# runs of a [4, 6, 5] tensor's 120 elements that start and end inside experts and rows
ODD_RUNS = [(0, 17), (17, 29), (46, 1), (47, 58), (105, 15)]


@pytest.mark.parametrize("expert", range(4))
def test_each_experts_gate_up_and_down_are_cut_from_runs_that_straddle_experts(expert):
    fused = {"fused": torch.randn(4, 6, 5)}  # [experts, 2 * intermediate, hidden]
    tiles = (whole("fused", (4, 6, 5)),)
    gate = drop_axis(narrow(narrow(tiles, 1, 0, 3), 0, expert, 1), 0)
    up = drop_axis(narrow(narrow(tiles, 1, 3, 3), 0, expert, 1), 0)
    torch.testing.assert_close(rebuild_from_runs(gate, fused, (3, 5), ODD_RUNS), fused["fused"][expert, :3])
    torch.testing.assert_close(rebuild_from_runs(up, fused, (3, 5), ODD_RUNS), fused["fused"][expert, 3:])
    # an expert's gate is one stretch of the flattened tensor: it meets at most two of these runs
    assert sum(len(select_runs(gate[0], (4, 6, 5), (3, 5), *run)) for run in ODD_RUNS) <= 2


def test_a_box_of_columns_is_cut_row_by_row_and_stacked_sources_land_at_their_offsets():
    weight = torch.randn(7, 4)
    columns = narrow((whole("w", (7, 4)),), 1, 1, 2)  # weight[:, 1:3]: 7 stretches of 2
    assert len(select_runs(columns[0], (7, 4), (7, 2), 0, 28)) == 7
    runs = [(0, 9), (9, 10), (19, 9)]
    torch.testing.assert_close(rebuild_from_runs(columns, {"w": weight}, (7, 2), runs), weight[:, 1:3])
    sources = {"w": weight, "v": torch.randn(7, 4)}
    stacked = concatenate([(insert_axis((whole(name, (7, 4)),), 0), 1) for name in sources], 0)
    torch.testing.assert_close(rebuild_from_runs(stacked, sources, (2, 7, 4), runs), torch.stack(list(sources.values())))


def test_a_transposed_tile_is_not_cut_from_runs():
    tiles = permute((whole("w", (7, 4)),), (1, 0))
    with pytest.raises(ValueError, match="transposed or strided tile of 'w'"):
        select_runs(tiles[0], (7, 4), (4, 7), 0, 28)


def test_a_box_index_finds_exactly_the_boxes_a_tile_meets():
    """A tensor saved a chunk per layer and expert, and tiles of it (whole, strided, a block of
    rows of one expert): the index finds the boxes `select` meets, no more, in order."""
    layers, experts, rows, columns = 3, 4, 6, 5
    boxes = [((layer, expert, half * 3, 0), (1, 1, 3, columns))
             for layer in range(layers) for expert in range(experts) for half in range(2)]
    boxes.append(((0, 0, 0, 0), (0, 0, 0, 0)))  # an empty box meets nothing
    index = BoxIndex(boxes)
    tiles = [
        whole("w", (layers, experts, rows, columns)),
        Tile("w", (0, 0), (2, columns), (1, 2, 2, 0), (2, 3)),
        Tile("w", (0, 0, 0), (experts, 2, columns), (2, 0, 1, 0), (1, 2, 3), steps=(1, 1, 3, 1)),
    ]
    for tile in tiles:
        expected = [position for position, (offset, shape) in enumerate(boxes) if select(tile, offset, shape) is not None]
        assert index.meeting(tile) == expected


def test_a_box_index_over_boxes_of_uneven_extents_finds_what_select_finds():
    """Chunks of uneven lengths along the axis the index sorts by (a long one reaching past
    several short ones): every tile, wherever it starts, meets exactly the boxes `select` does."""
    extents = [1, 4, 1, 1, 3, 2, 1, 5, 1]
    boxes, start = [], 0
    for extent in extents:
        boxes += [((start, half * 2), (extent, 2)) for half in range(3)]
        start += extent
    index = BoxIndex(boxes)
    for first in range(start):
        for length in range(1, start - first + 1):
            for column in range(6):
                tile = Tile("w", (0, 0), (length, 1), (first, column), (0, 1))
                expected = [position for position, (offset, shape) in enumerate(boxes) if select(tile, offset, shape) is not None]
                assert index.meeting(tile) == expected, (first, length, column)
