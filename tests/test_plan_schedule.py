"""rayexport.plan.schedule: output files, buckets, packed buffers, rank and writer assignment."""

import json
import struct

import pytest
import torch
from safetensors.torch import save as safetensors_save

from rayexport.plan.naming import TensorPlan
from rayexport.plan.pieces import Piece
from rayexport.plan.schedule import (
    PACK_ALIGNMENT, Bucket, ShardFile, assign_ranks, assign_writers, packed_offsets, plan_buckets, plan_shard_files,
    plan_transfer, received_bytes, sent_bytes, staging_bytes,
)

from support.plan_cases import EMBED, HEAD, TIED, chunk_sizes


# --- plan_shard_files -----------------------------------------------------------------------


def whole(name, shape, dtype="float32", source_dtype=None):
    source_dtype = source_dtype or dtype
    return TensorPlan(name, name, tuple(shape), source_dtype, dtype, (Piece(0, name, (0,) * len(shape), tuple(shape), source_dtype),))


def test_plan_shard_files_single_file_when_it_fits():
    plans = [whole("b", (4, 4)), whole("a", (4,)), whole("c", ())]
    files, split = plan_shard_files(plans, 10_000)
    assert not split.is_sharded
    assert len(files) == 1
    assert files[0].filename == "model.safetensors"
    assert sorted(files[0].tensors) == ["a", "b", "c"]


def test_plan_shard_files_split_names_and_coverage():
    plans = [whole(f"layer{i}.weight", (10, 10)) for i in range(5)]  # 400 bytes each
    files, split = plan_shard_files(plans, 900)
    assert split.is_sharded and split.metadata == {"total_size": 2000}
    assert split.tensor_to_filename == {name: shard.filename for shard in files for name in shard.tensors}
    assert [shard.filename for shard in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [len(shard.tensors) for shard in files] == [2, 2, 1]
    assert sorted(name for shard in files for name in shard.tensors) == sorted(plan.name for plan in plans)


def file_sizes(files, plans):
    size = {plan.name: plan.nbytes for plan in plans}
    return [sum(size[name] for name in shard.tensors) for shard in files]


def test_several_writers_get_files_of_about_equal_size(monkeypatch):
    """An export of at least a share per writer is written as one file per writer, their sizes
    within one tensor of each other, where huggingface_hub's rule alone makes a full file and a
    remainder (or one file)."""
    import rayexport.plan.schedule as schedule

    monkeypatch.setattr(schedule, "WRITER_SHARE", 1000)
    plans = [whole(f"layer{i}.weight", (10, 10 + i)) for i in range(12)]  # 400-840 bytes, 7440 in all
    assert file_sizes(plan_shard_files(plans, 5000)[0], plans) == [4320, 3120]  # huggingface_hub's rule
    files, split = plan_shard_files(plans, 5000, writers=2)
    assert file_sizes(files, plans) == [3640, 3800]
    assert [shard.filename for shard in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert split.metadata == {"total_size": 7440}
    assert split.tensor_to_filename == {name: shard.filename for shard in files for name in shard.tensors}
    assert [name for shard in files for name in sorted(shard.tensors, key=lambda name: int(name[5:-7]))] == [plan.name for plan in plans]
    assert file_sizes(plan_shard_files(plans, 10_000, writers=3)[0], plans) == [2400, 2640, 2400]
    # more files than writers where --max-shard-size needs them: a multiple of the writers, each within it
    sizes = file_sizes(plan_shard_files(plans, 2000, writers=2)[0], plans)
    assert len(sizes) % 2 == 0 and max(sizes) <= 2000
    # below a share per writer: as many writers as shares, or the plain rule's one file
    assert len(plan_shard_files(plans, 10_000, writers=8)[0]) == 7
    monkeypatch.setattr(schedule, "WRITER_SHARE", 4000)
    assert len(plan_shard_files(plans, 10_000, writers=2)[0]) == 1


def test_plan_shard_files_uses_output_dtype_size():
    plans = [whole(f"w{i}", (10, 10), dtype="bfloat16", source_dtype="float32") for i in range(4)]  # 200 B out
    assert len(plan_shard_files(plans, 800)[0]) == 1


def test_plan_shard_files_order_in_file_matches_safetensors():
    """In-file order is the order safetensors.torch.save lays the same tensors out in."""
    specs = {
        "z.f32": ((3,), torch.float32), "a.f32": ((2, 2), torch.float32), "m.bf16": ((5,), torch.bfloat16),
        "b.i64": ((2,), torch.int64), "c.bool": ((3,), torch.bool), "d.f16": ((), torch.float16),
        "e.u8": ((4,), torch.uint8), "f.i32": ((1,), torch.int32), "g.f64": ((1,), torch.float64),
    }
    plans = [whole(name, shape, str(dtype).removeprefix("torch.")) for name, (shape, dtype) in specs.items()]
    (shard,), _ = plan_shard_files(plans, 1 << 20)
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
    from rayexport.plan.schedule import keep_ties_together

    moved = keep_ties_together([[EMBED, "a"], [HEAD, "b"]], TIED, {})
    assert moved == [[EMBED, "a", HEAD], ["b"]]
    assert keep_ties_together([[EMBED, HEAD], ["b"]], TIED, {}) == [[EMBED, HEAD], ["b"]]


def test_keep_ties_together_matches_stored_keys_by_model_name():
    """torch.compile saves `_orig_mod.` keys: the tie is still found, as the planning finds it."""
    from rayexport.plan.schedule import keep_ties_together

    embed, head = "_orig_mod." + EMBED, "_orig_mod." + HEAD
    name_of = {embed: EMBED, head: HEAD, "b": "b"}
    assert keep_ties_together([[head, "b"], [embed]], TIED, name_of) == [["b"], [head, embed]]


def test_keep_ties_together_keeps_aliases_without_their_canonical_together():
    from rayexport.plan.schedule import keep_ties_together

    ties = {"encoder.embed_tokens.weight": "shared.weight", "decoder.embed_tokens.weight": "shared.weight"}
    moved = keep_ties_together([["encoder.embed_tokens.weight"], ["decoder.embed_tokens.weight", "b"]], ties, {})
    assert moved == [["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"], ["b"]]



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


def test_each_staging_slot_holds_the_largest_bucket_a_worker_sends_or_receives_and_the_totals_add_up():
    def piece(rank, nbytes):
        return Piece(rank, f"k{rank}.{nbytes}", (0,), (nbytes,), "uint8")

    buckets = (
        # written by 0: 1 sends 20 bytes (32 once aligned), 2 sends 16 + 1 (16 + 16); 0's own stay
        Bucket(("a",), ((piece(0, 8),), (piece(1, 20),), (piece(2, 16), piece(2, 1))), writer=0),
        # written by 1: 0 sends 100 bytes (112), 2 sends nothing
        Bucket(("b",), ((piece(0, 100),), (piece(1, 4),), ()), writer=1),
    )
    assert staging_bytes(buckets, 0) == 112  # its send to 1 outweighs the 64 it receives
    assert staging_bytes(buckets, 1) == 112  # receives 112 in "b", sends 32 in "a"
    assert staging_bytes(buckets, 2) == 32
    assert [sent_bytes(buckets, rank) for rank in range(3)] == [112, 32, 32]
    assert [received_bytes(buckets, rank) for rank in range(3)] == [64, 112, 0]
