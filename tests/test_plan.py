"""rayexport.plan: pure planning over rank-file metadata (no I/O, no process groups)."""

import itertools
import json
import math
import struct

import pytest
import torch
from safetensors.torch import save as safetensors_save

from rayexport.errors import ExportError
from rayexport.layouts.verl import ShardInfo
from rayexport.plan import (
    PACK_ALIGNMENT,
    Piece,
    ShardFile,
    TensorPlan,
    assign_ranks,
    needed_ranks,
    output_dtype,
    packed_offsets,
    assign_writers,
    plan_buckets,
    plan_transfer,
    plan_shard_files,
    holders_from_ranks,
    plan_holdings,
    shard_extent,
)



def plan_tensors(rank_infos, *args, **kwargs):
    """Planning for rank files, as the exporter does it for a verl checkpoint."""
    return plan_holdings(holders_from_ranks(rank_infos), *args, **kwargs)


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


# --- plan_tensors ---------------------------------------------------------------------------


def test_plan_tensors_dtensor_pieces_and_tied_alias_dropped():
    world = 3
    shapes = {EMBED: (10, 4), NORM: (4,), HEAD: (10, 4), "tiny.bias": (2,)}
    ranks = fsdp2_ranks({"_orig_mod." + EMBED: (10, 4), NORM: (4,), HEAD: (10, 4), "tiny.bias": (2,)}, world)
    planning = plan_tensors(ranks, expected_of(shapes), TIED, "auto", None)

    by_name = {plan.name: plan for plan in planning.tensors}
    assert set(by_name) == {EMBED, NORM, "tiny.bias"}
    assert planning.resolution.dropped == [HEAD] and planning.resolution.to_compare == [(EMBED, HEAD)]
    assert planning.tied_key_pairs == [("_orig_mod." + EMBED, HEAD)]  # the keys to compare values of
    embed = by_name[EMBED]
    assert embed.source_key == "_orig_mod." + EMBED and embed.shape == (10, 4)
    assert [(p.rank, p.offset, p.shape) for p in embed.pieces] == [
        (0, (0, 0), (4, 4)), (1, (4, 0), (4, 4)), (2, (8, 0), (2, 4))
    ]
    assert all(p.source_key == "_orig_mod." + EMBED for p in embed.pieces)
    # 2 rows over 3 ranks: rank 2 holds nothing and contributes no piece
    assert [(p.rank, p.offset, p.shape) for p in by_name["tiny.bias"].pieces] == [(0, (0,), (1,)), (1, (1,), (1,))]


def test_plan_tensors_empty_dtensor_still_has_one_piece():
    plans = plan_tensors(fsdp2_ranks({NORM: (0, 4)}, 2), expected_of({NORM: (0, 4)}), {}, "auto", None).tensors
    assert [(p.rank, p.offset, p.shape) for p in plans[0].pieces] == [(0, (0, 0), (0, 4))]


def test_plan_tensors_promotes_an_alias_whose_canonical_is_missing():
    ranks = fsdp2_ranks({HEAD: (10, 4), NORM: (4,)}, 2)
    expected = expected_of({EMBED: (10, 4), NORM: (4,), HEAD: (10, 4)})
    planning = plan_tensors(ranks, expected, TIED, "auto", None)
    by_name = {plan.name: plan for plan in planning.tensors}
    assert set(by_name) == {EMBED, NORM}
    assert by_name[EMBED].source_key == HEAD
    assert all(piece.source_key == HEAD for piece in by_name[EMBED].pieces)
    assert planning.resolution.promoted == {HEAD: EMBED}
    assert planning.tied_key_pairs == []


def test_plan_tensors_tied_checkpoint_with_only_the_embedding():
    """BRIEF 1.3: no KeyError for lm_head.weight, nothing reported missing."""
    ranks = fsdp2_ranks({EMBED: (10, 4), NORM: (4,)}, 2)
    expected = expected_of({EMBED: (10, 4), NORM: (4,), HEAD: (10, 4)})
    planning = plan_tensors(ranks, expected, TIED, "auto", None)
    assert sorted(plan.name for plan in planning.tensors) == [EMBED, NORM]
    assert planning.resolution.dropped == [] and planning.resolution.promoted == {}


def test_plan_tensors_untied_model_keeps_both():
    ranks = fsdp2_ranks({EMBED: (10, 4), HEAD: (10, 4)}, 2)
    plans = plan_tensors(ranks, expected_of({EMBED: (10, 4), HEAD: (10, 4)}), {}, "auto", None).tensors
    assert sorted(plan.name for plan in plans) == [HEAD, EMBED]


def test_plan_tensors_plain_fsdp1_tensors():
    """Plain tensors: sharded along dim 0 in rank order, or replicated (0-d, buffers)."""
    local = {
        "_fsdp_wrapped_module." + EMBED: [(4, 4), (4, 4), (2, 4)],
        "_fsdp_wrapped_module.model.rotary.inv_freq": [(8,), (8,), (8,)],
        "_fsdp_wrapped_module.model.scale": [(), (), ()],
        "_fsdp_wrapped_module.model.uneven": [(0, 3), (5, 3), (1, 3)],
    }
    ranks = {
        rank: {key: ShardInfo(local_shape=shapes[rank], dtype="float32") for key, shapes in local.items()}
        for rank in range(3)
    }
    expected = expected_of({EMBED: (10, 4), "model.rotary.inv_freq": (8,), "model.scale": (), "model.uneven": (6, 3)})
    plans = plan_tensors(ranks, expected, {}, "auto", None).tensors
    pieces = {plan.name: [(p.rank, p.offset, p.shape) for p in plan.pieces] for plan in plans}
    assert pieces[EMBED] == [(0, (0, 0), (4, 4)), (1, (4, 0), (4, 4)), (2, (8, 0), (2, 4))]
    assert pieces["model.rotary.inv_freq"] == [(0, (0,), (8,))]
    assert pieces["model.scale"] == [(0, (), ())]
    assert [offset for _, offset, _ in pieces["model.uneven"]] == [(0, 0), (0, 0), (5, 0)]
    assert sum(shape[0] for _, _, shape in pieces["model.uneven"]) == 6


def test_plan_tensors_hsdp_reads_the_first_replica_only():
    def info(rank):
        coordinate = (rank // 2, rank % 2)
        return {EMBED: ShardInfo(
            local_shape=((5, 4), (4, 4))[coordinate[1]], dtype="float32", global_shape=(9, 4),
            placements=("R", "S0"), mesh_shape=(2, 2), mesh_ranks=(0, 1, 2, 3), coordinate=coordinate,
        )}

    plans = plan_tensors({rank: info(rank) for rank in range(4)}, expected_of({EMBED: (9, 4)}), {}, "auto", None).tensors
    assert [(p.rank, p.offset, p.shape) for p in plans[0].pieces] == [(0, (0, 0), (5, 4)), (1, (5, 0), (4, 4))]


def test_plan_tensors_missing_key_is_named():
    ranks = fsdp2_ranks({EMBED: (10, 4)}, 2)
    with pytest.raises(ExportError, match=f"'{NORM}'"):
        plan_tensors(ranks, expected_of({EMBED: (10, 4), NORM: (4,)}), {}, "auto", None)


def test_plan_tensors_unexpected_key_is_named_by_its_source_key():
    ranks = fsdp2_ranks({EMBED: (10, 4), "_fsdp_wrapped_module.extra.bias": (3,)}, 2)
    with pytest.raises(ExportError, match=r"'_fsdp_wrapped_module\.extra\.bias'"):
        plan_tensors(ranks, expected_of({EMBED: (10, 4)}), {}, "auto", None)


def test_plan_tensors_rank_files_with_different_keys():
    ranks = fsdp2_ranks({EMBED: (10, 4), NORM: (4,)}, 3)
    del ranks[2][NORM]
    with pytest.raises(ExportError, match=f"disagree.*'{NORM}'") as raised:
        plan_tensors(ranks, expected_of({EMBED: (10, 4), NORM: (4,)}), {}, "auto", None)
    assert "rank 0" in str(raised.value)


def test_plan_tensors_two_keys_normalizing_to_one_name():
    ranks = fsdp2_ranks({NORM: (4,), "module." + NORM: (4,)}, 2)
    with pytest.raises(ExportError, match="both name"):
        plan_tensors(ranks, expected_of({NORM: (4,)}), {}, "auto", None)


def test_plan_tensors_plain_shards_that_do_not_add_up():
    ranks = {rank: {EMBED: ShardInfo(local_shape=(4, 4), dtype="float32")} for rank in range(3)}
    with pytest.raises(ExportError, match=f"'{EMBED}'.*do not add up.*10, 4"):
        plan_tensors(ranks, expected_of({EMBED: (10, 4)}), {}, "auto", None)


def test_plan_tensors_plain_shards_with_wrong_trailing_dims():
    ranks = {0: {EMBED: ShardInfo((5, 4), "float32")}, 1: {EMBED: ShardInfo((5, 3), "float32")}}
    with pytest.raises(ExportError, match="do not add up"):
        plan_tensors(ranks, expected_of({EMBED: (10, 4)}), {}, "auto", None)


def test_plan_tensors_global_shape_differs_from_config():
    ranks = fsdp2_ranks({EMBED: (12, 4)}, 2)
    with pytest.raises(ExportError, match=r"global shape \[12, 4\].*expects \[10, 4\]"):
        plan_tensors(ranks, expected_of({EMBED: (10, 4)}), {}, "auto", None)


def test_plan_tensors_local_shape_contradicting_placement():
    ranks = fsdp2_ranks({EMBED: (10, 4)}, 2)
    ranks[1][EMBED] = ShardInfo(
        local_shape=(4, 4), dtype="float32", global_shape=(10, 4), placements=("S0",),
        mesh_shape=(2,), mesh_ranks=(0, 1), coordinate=(1,),
    )
    with pytest.raises(ExportError, match="rank 1"):
        plan_tensors(ranks, expected_of({EMBED: (10, 4)}), {}, "auto", None)


def test_plan_tensors_dtypes_differ_across_ranks():
    ranks = fsdp2_ranks({NORM: (4,)}, 2)
    ranks[1] = fsdp2_ranks({NORM: (4,)}, 2, {NORM: "bfloat16"})[1]
    with pytest.raises(ExportError, match="different dtypes"):
        plan_tensors(ranks, expected_of({NORM: (4,)}), {}, "auto", None)


def test_plan_tensors_dtensor_in_some_ranks_plain_in_others():
    ranks = fsdp2_ranks({NORM: (4,)}, 2)
    ranks[1][NORM] = ShardInfo(local_shape=(2,), dtype="float32")
    with pytest.raises(ExportError, match="DTensor in some"):
        plan_tensors(ranks, expected_of({NORM: (4,)}), {}, "auto", None)


def test_plan_tensors_output_dtypes():
    dtypes = {EMBED: "float32", "model.position_ids": "int64", "model.mask": "bool"}
    shapes = {EMBED: (10, 4), "model.position_ids": (6,), "model.mask": (6,)}
    ranks = fsdp2_ranks(shapes, 2, dtypes)
    plans = plan_tensors(ranks, expected_of(shapes, dtypes), {}, "auto", "bfloat16").tensors
    assert {plan.name: (plan.source_dtype, plan.dtype) for plan in plans} == {
        EMBED: ("float32", "bfloat16"),
        "model.position_ids": ("int64", "int64"),
        "model.mask": ("bool", "bool"),
    }
    assert {plan.name: plan.nbytes for plan in plans}[EMBED] == 10 * 4 * 2


# --- output_dtype ---------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["int64", "int32", "int8", "uint8", "bool"])
@pytest.mark.parametrize("requested", ["auto", "bfloat16", "float32"])
def test_output_dtype_never_casts_integers_or_bools(source, requested):
    assert output_dtype(source, requested, "bfloat16") == source


def test_output_dtype_auto_uses_the_config_dtype():
    assert output_dtype("float32", "auto", "bfloat16") == "bfloat16"
    assert output_dtype("bfloat16", "auto", "float32") == "float32"
    assert output_dtype("float16", "auto", None) == "float16"


def test_output_dtype_explicit_request_wins():
    assert output_dtype("float32", "float16", "bfloat16") == "float16"
    assert output_dtype("bfloat16", "float32", "bfloat16") == "float32"


def test_output_dtype_rejects_what_safetensors_cannot_hold():
    with pytest.raises(ExportError, match="complex64"):
        output_dtype("complex64", "auto", None)


# --- plan_shard_files -----------------------------------------------------------------------


def whole(name, shape, dtype="float32", source_dtype=None):
    source_dtype = source_dtype or dtype
    return TensorPlan(name, name, tuple(shape), source_dtype, dtype, (Piece(0, name, (0,) * len(shape), tuple(shape), source_dtype),))


def test_plan_shard_files_single_file_when_it_fits():
    plans = [whole("b", (4, 4)), whole("a", (4,)), whole("c", ())]
    files = plan_shard_files(plans, 10_000)
    assert len(files) == 1
    assert files[0].filename == "model.safetensors"
    assert sorted(files[0].tensors) == ["a", "b", "c"]


def test_plan_shard_files_split_names_and_coverage():
    plans = [whole(f"layer{i}.weight", (10, 10)) for i in range(5)]  # 400 bytes each
    files = plan_shard_files(plans, 900)
    assert [shard.filename for shard in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [len(shard.tensors) for shard in files] == [2, 2, 1]
    assert sorted(name for shard in files for name in shard.tensors) == sorted(plan.name for plan in plans)


def test_plan_shard_files_uses_output_dtype_size():
    plans = [whole(f"w{i}", (10, 10), dtype="bfloat16", source_dtype="float32") for i in range(4)]  # 200 B out
    assert len(plan_shard_files(plans, 800)) == 1


def test_plan_shard_files_order_in_file_matches_safetensors():
    """In-file order is the order safetensors.torch.save lays the same tensors out in."""
    specs = {
        "z.f32": ((3,), torch.float32), "a.f32": ((2, 2), torch.float32), "m.bf16": ((5,), torch.bfloat16),
        "b.i64": ((2,), torch.int64), "c.bool": ((3,), torch.bool), "d.f16": ((), torch.float16),
        "e.u8": ((4,), torch.uint8), "f.i32": ((1,), torch.int32), "g.f64": ((1,), torch.float64),
    }
    plans = [whole(name, shape, str(dtype).removeprefix("torch.")) for name, (shape, dtype) in specs.items()]
    (shard,) = plan_shard_files(plans, 1 << 20)
    data = safetensors_save({name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in specs.items()})
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__", None)
    library_order = sorted(header, key=lambda name: header[name]["data_offsets"])
    assert list(shard.tensors) == library_order


# --- plan_buckets and packed_offsets --------------------------------------------------------


def sharded(name, rows, cols, world_size, dtype="float32"):
    pieces, row = [], 0
    for rank, size in enumerate(chunk_sizes(rows, world_size)):
        if size:
            pieces.append(Piece(rank, name, (row, 0), (size, cols), dtype))
        row += size
    return TensorPlan(name, name, (rows, cols), dtype, dtype, tuple(pieces))


def test_plan_buckets_respects_size_and_order():
    plans = [sharded(f"t{i}", rows, 4, 4) for i, rows in enumerate([3, 8, 2, 5, 9, 1])]  # 16 B per row
    buckets = plan_buckets(plans, {0: 0, 1: 0, 2: 1, 3: 1}, 2, bucket_size=200)
    assert [name for bucket in buckets for name in bucket.tensors] == [plan.name for plan in plans]
    by_name = {plan.name: plan for plan in plans}
    for bucket in buckets:
        gathered = sum(piece.nbytes for name in bucket.tensors for piece in by_name[name].pieces)
        assert gathered <= 200
    assert len(buckets) > 1
    # greedy: the next tensor would not have fitted in the previous bucket
    for previous, following in zip(buckets, buckets[1:]):
        size = sum(by_name[name].nbytes for name in previous.tensors)
        assert size + by_name[following.tensors[0]].nbytes > 200


def test_plan_buckets_oversize_tensor_travels_alone():
    plans = [sharded("small1", 1, 4, 2), sharded("huge", 100, 4, 2), sharded("small2", 1, 4, 2)]
    buckets = plan_buckets(plans, {0: 0, 1: 1}, 2, bucket_size=64)
    assert [bucket.tensors for bucket in buckets] == [("small1",), ("huge",), ("small2",)]


def test_plan_buckets_one_bucket_when_everything_fits():
    plans = [sharded(f"t{i}", 4, 4, 2) for i in range(3)]
    assert [bucket.tensors for bucket in plan_buckets(plans, {0: 0, 1: 1}, 2, bucket_size=10_000)] == [
        ("t0", "t1", "t2")
    ]


def test_plan_buckets_sends_per_worker():
    plans = [sharded("a", 10, 2, 4), sharded("b", 3, 2, 4)]  # b: ranks 0, 1, 2 only
    worker_of_rank = {0: 0, 1: 0, 2: 1, 3: 2}
    (bucket,) = plan_buckets(plans, worker_of_rank, 3, bucket_size=10_000)
    assert len(bucket.sends) == 3
    for worker, pieces in enumerate(bucket.sends):
        assert all(worker_of_rank[piece.rank] == worker for piece in pieces)
    assert [(p.source_key, p.rank) for p in bucket.sends[0]] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert [(p.source_key, p.rank) for p in bucket.sends[1]] == [("a", 2), ("b", 2)]
    assert [(p.source_key, p.rank) for p in bucket.sends[2]] == [("a", 3)]
    sent = [piece for pieces in bucket.sends for piece in pieces]
    assert len(sent) == len(set(sent)) and set(sent) == set(plans[0].pieces + plans[1].pieces)


def test_packed_offsets_are_aligned_and_do_not_overlap():
    pieces = (
        Piece(0, "a", (0,), (1,), "float32"),  # 4 B
        Piece(0, "b", (0,), (3,), "bfloat16"),  # 6 B
        Piece(0, "c", (0, 0), (0, 7), "float32"),  # empty
        Piece(0, "d", (), (), "int64"),  # 8 B, 0-d
        Piece(0, "e", (0,), (16,), "uint8"),  # exactly 16 B
        Piece(0, "f", (0,), (17,), "bool"),  # 17 B
    )
    offsets, size = packed_offsets(pieces)
    assert offsets == [0, 16, 32, 32, 48, 64]
    assert size == 96
    assert all(offset % PACK_ALIGNMENT == 0 for offset in offsets)
    for offset, following, piece in zip(offsets, offsets[1:] + [size], pieces):
        assert offset + piece.nbytes <= following


def test_packed_offsets_empty():
    assert packed_offsets(()) == ([], 0)


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


def test_assign_ranks_contiguous_blocks():
    assert assign_ranks([0, 1, 2, 3], 2) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert assign_ranks([0, 1], 4) == {0: 0, 1: 1}
    assert assign_ranks([0], 3) == {0: 0}


@pytest.mark.parametrize("ranks, workers", [([3, 0, 2, 1], 2), ([0, 2], 2), (list(range(7)), 3), (list(range(5)), 4)])
def test_assign_ranks_keeps_rank_zero_on_worker_zero(ranks, workers):
    assignment = assign_ranks(ranks, workers)
    assert assignment[0] == 0
    assert set(assignment) == set(ranks)
    assert all(0 <= worker < workers for worker in assignment.values())
    ordered = [assignment[rank] for rank in sorted(ranks)]
    assert ordered == sorted(ordered)  # contiguous blocks in rank order


def test_keep_ties_together_moves_the_alias_to_its_canonical_worker():
    from rayexport.plan import keep_ties_together

    moved = keep_ties_together([[EMBED, "a"], [HEAD, "b"]], TIED)
    assert moved == [[EMBED, "a", HEAD], ["b"]]
    assert keep_ties_together([[EMBED, HEAD], ["b"]], TIED) == [[EMBED, HEAD], ["b"]]


# --- plan_transfer: several writers ---------------------------------------------------------


def test_assign_writers_balances_bytes_largest_first():
    plans = {f"t{i}": sharded(f"t{i}", rows, 4, 2) for i, rows in enumerate([10, 1, 9, 2, 8])}
    files = [ShardFile(f"f{i}", (f"t{i}",)) for i in range(5)]
    writers = assign_writers(files, plans, 2)
    loads = [sum(plans[f"t{i}"].nbytes for i, writer in enumerate(writers) if writer == w) for w in range(2)]
    assert writers == [0, 0, 1, 0, 1]  # by rows: 10 -> w0, 9 -> w1, 8 -> w1, 2 -> w0, 1 -> w0
    assert abs(loads[0] - loads[1]) <= max(plan.nbytes for plan in plans.values())


def test_plan_transfer_interleaves_writers_and_keeps_each_writers_order():
    plans = {f"t{i}": sharded(f"t{i}", 4, 4, 2) for i in range(8)}  # 64 B each
    files = [ShardFile(f"f{i}", (f"t{2 * i}", f"t{2 * i + 1}")) for i in range(4)]
    transfer = plan_transfer(files, plans, {0: 0, 1: 1}, 2, bucket_size=64, writers=2)
    assert [bucket.writer for bucket in transfer.buckets] == [0, 1] * 4
    for writer in range(2):
        mine = [name for bucket in transfer.buckets if bucket.writer == writer for name in bucket.tensors]
        assert mine == [name for shard in transfer.files[writer] for name in shard.tensors]
    assert sorted(shard.filename for files_ in transfer.files for shard in files_) == [f"f{i}" for i in range(4)]


def test_plan_transfer_never_has_more_writers_than_workers_or_files():
    plans = {"t0": sharded("t0", 4, 4, 2)}
    transfer = plan_transfer([ShardFile("model.safetensors", ("t0",))], plans, {0: 0, 1: 1}, 2, 1 << 20, writers=4)
    assert {bucket.writer for bucket in transfer.buckets} == {0}
    assert transfer.files == ((ShardFile("model.safetensors", ("t0",)),), ())
