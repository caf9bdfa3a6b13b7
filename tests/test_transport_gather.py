"""rayexport.transport.gather: the real uneven gather over gloo, its window and its failures."""

import time

import pytest
import torch
import torch.multiprocessing as multiprocessing
from support.plan_cases import piece_region, plan_tensors

from rayexport.plan.naming import TensorPlan
from rayexport.plan.pieces import Piece
from rayexport.plan.schedule import Bucket, ShardFile, assign_ranks, packed_offsets, plan_transfer
from rayexport.plan.shards import ShardInfo
from rayexport.transport.gather import run_transfer, worker_steps

CPU = torch.device("cpu")


WORLD = 2


def gather_case():
    """Full tensors, and each rank's ShardInfo for them, as a 2-rank checkpoint holds them."""
    generator = torch.Generator().manual_seed(7)
    full = {
        "a.weight": torch.randn(5, 3, generator=generator),  # S0: 3 + 2 rows
        "f.plain": torch.randn(2, 2, generator=generator),  # plain: 2 + 0 rows, a bucket of its own
        "c.weight": torch.arange(24, dtype=torch.int64).reshape(4, 6),  # S1: 3 + 3 columns
        "b.weight": torch.randn(1, 4, generator=generator).to(torch.bfloat16),  # S0: 1 + 0 rows
        "d.mask": torch.tensor([True, False, True, True, False, False, True]),  # S0: 4 + 3
        "e.plain": torch.randn(3, 2, generator=generator).to(torch.float16),  # plain: 0 + 3 rows
        "g.scale": torch.tensor(0.75),  # plain 0-d, replicated
    }
    dtensor = {"a.weight": 0, "b.weight": 0, "c.weight": 1, "d.mask": 0}
    plain_rows = {"e.plain": (0, 3), "f.plain": (2, 0)}
    infos = {rank: {} for rank in range(WORLD)}
    for name, tensor in full.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        for rank in range(WORLD):
            if name in dtensor:
                dim = dtensor[name]
                sizes = [len(chunk) for chunk in torch.arange(tensor.shape[dim]).chunk(WORLD)]
                local = list(tensor.shape)
                local[dim] = (sizes + [0] * WORLD)[rank]
                infos[rank][name] = ShardInfo(
                    tuple(local), dtype, tuple(tensor.shape), (f"S{dim}",), (WORLD,), tuple(range(WORLD)), (rank,)
                )
            elif name in plain_rows:
                infos[rank][name] = ShardInfo((plain_rows[name][rank],) + tuple(tensor.shape[1:]), dtype)
            else:
                infos[rank][name] = ShardInfo(tuple(tensor.shape), dtype)
    return full, infos


def gather_plan(writers=1):
    full, infos = gather_case()
    expected = {name: (tuple(tensor.shape), "") for name, tensor in full.items()}
    plans = {plan.name: plan for plan in plan_tensors(infos, expected, {}).tensors}
    files = [ShardFile(f"part{i}", tuple(names)) for i, names in enumerate(
        [("e.plain", "a.weight"), ("b.weight", "d.mask", "c.weight"), ("f.plain", "g.scale")]
    )]
    transfer = plan_transfer(files, plans, assign_ranks(list(range(WORLD)), WORLD), WORLD, bucket_size=40, writers=writers)
    return full, plans, transfer


def _gather_rank(rank, rendezvous, result_dir, writers):
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        full, plans, transfer = gather_plan(writers)

        def local_pieces(pieces):
            assert all(piece.rank == rank for piece in pieces), f"rank {rank} asked for another rank's piece"
            return [piece_region(full[piece.source_key], piece) for piece in pieces]  # views, as a mapped file gives

        def write(tensors):
            return {name: torch.cat([chunk.reshape(-1) for chunk in chunks]).clone() for name, chunks in tensors}

        files = transfer.files[rank]
        gathered = run_transfer(rank, transfer.buckets, plans, local_pieces, CPU, write if files else None)
        torch.save(gathered or {}, f"{result_dir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("writers", [1, 2])
def test_gather_over_gloo_with_uneven_and_empty_shards(tmp_path, writers):
    full, plans, transfer = gather_plan(writers)
    buckets = transfer.buckets
    # the case covers what it claims: several buckets, and worker 1 holding no rows of some tensors
    assert len(buckets) > 2
    assert [p.rank for p in plans["b.weight"].pieces] == [0]
    assert [p.shape for p in plans["e.plain"].pieces] == [(0, 2), (3, 2)]
    # a bucket where a sender's only piece is empty: it sends nothing and its writer expects nothing
    assert any(
        pieces and packed_offsets(pieces)[1] == 0
        for bucket in buckets for worker, pieces in enumerate(bucket.sends) if worker != bucket.writer
    )
    assert {bucket.writer for bucket in buckets} == set(range(writers))

    multiprocessing.spawn(_gather_rank, args=(str(tmp_path / "rendezvous"), str(tmp_path), writers), nprocs=WORLD)
    for rank in range(WORLD):
        gathered = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        # each writer received exactly the tensors of its files, in file order
        assert list(gathered) == [name for shard in transfer.files[rank] for name in shard.tensors]
        for name, flat in gathered.items():
            original = full[name]
            assert flat.dtype == original.dtype, name
            assert torch.equal(flat, original.reshape(-1)), name


# --- the transfer window, in one process (a single worker holds every piece) -------------------


def single_worker_case(tensors=6, rows=4):
    full = {f"t{i}": torch.full((rows, 4), float(i)) for i in range(tensors)}
    plans = {
        name: TensorPlan(name, name, (rows, 4), "float32", "float32", (Piece(0, name, (0, 0), (rows, 4), "float32"),))
        for name in full
    }
    transfer = plan_transfer([ShardFile("model.safetensors", tuple(full))], plans, {0: 0}, 1, bucket_size=64)
    assert len(transfer.buckets) == tensors  # one 64-byte tensor per bucket
    return full, plans, transfer


def test_the_writer_never_falls_more_than_the_window_behind():
    full, plans, transfer = single_worker_case()
    received, written, lag = [], [], []

    def local_pieces(pieces):
        received.extend(piece.source_key for piece in pieces)
        return [full[piece.source_key] for piece in pieces]

    def write(tensors):
        for name, chunks in tensors:
            time.sleep(0.05)  # a slow upload: the gather must wait for it, not pile up buckets
            lag.append(len(received) - len(written))
            written.append(name)
        return written

    assert run_transfer(0, transfer.buckets, plans, local_pieces, CPU, write, window=2) == list(full)
    assert max(lag) == 2  # the next bucket was received while this one was written, and no more


def test_a_failing_writer_ends_the_transfer_with_its_error():
    full, plans, transfer = single_worker_case()

    def write(tensors):
        next(tensors)
        raise OSError("upload of model.safetensors refused")

    with pytest.raises(OSError, match="upload of model.safetensors refused"):
        run_transfer(0, transfer.buckets, plans, lambda pieces: [full[piece.source_key] for piece in pieces], CPU, write, window=2)


def test_the_gpu_is_the_first_assigned_one_among_the_visible_devices():
    from rayexport.transport.gather import cuda_device

    assert cuda_device([5], "5") == torch.device("cuda", 0)  # Ray narrowed visibility to the actor's GPU
    assert cuda_device([5, 6], "5,6") == torch.device("cuda", 0)
    assert cuda_device([5], None) == torch.device("cuda", 5)  # Ray left visibility alone
    assert cuda_device([5], "0,2,5,7") == torch.device("cuda", 2)
    assert cuda_device([], "1") == torch.device("cuda", 0)  # started without Ray
    with pytest.raises(Exception, match="GPU 5 assigned by Ray is not among CUDA_VISIBLE_DEVICES=1,2"):
        cuda_device([5], "1,2")


def test_a_writer_sends_its_share_of_the_next_bucket_while_its_own_arrives():
    """Two workers writing alternate buckets: each posts the receives of a bucket it writes and
    sends its share of the next one meanwhile, instead of after (when the pair took turns).
    Every share is still sent once, in the planned order, and a window of one slot has no room
    for it."""

    def bucket(index: int, writer: int):
        piece = lambda rank: (Piece(rank, f"t{index}", (0,), (4,), "float32"),)
        return Bucket((f"t{index}",), (piece(0), piece(1)), writer)

    buckets = tuple(bucket(index, index % 2) for index in range(4))
    names = lambda steps: [(own.tensors[0], ahead.tensors[0] if ahead else None) for own, ahead in steps]
    assert names(worker_steps(buckets, 0)) == [("t0", "t1"), ("t2", "t3")]
    assert names(worker_steps(buckets, 1)) == [("t0", None), ("t1", "t2"), ("t3", None)]
    assert names(worker_steps(buckets, 1, window=1)) == [("t0", None), ("t1", None), ("t2", None), ("t3", None)]
    for rank in (0, 1):  # each bucket this worker sends to, once and in order
        sends = [b for own, ahead in worker_steps(buckets, rank) for b in (own, ahead) if b and b.writer != rank]
        assert sends == [b for b in buckets if b.writer != rank]
