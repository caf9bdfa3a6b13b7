"""rayexport.transport.assembly: pieces packed into one buffer and viewed back, and output tensors put
together from uneven, empty and 2-D pieces."""

import torch
from support.plan_cases import piece_region

from rayexport.plan.naming import TensorPlan
from rayexport.plan.pieces import Piece
from rayexport.plan.schedule import packed_offsets
from rayexport.transport.assembly import assemble, output_chunks, pack, unpack


def test_pack_unpack_round_trip_mixed_dtypes():
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 6, generator=generator)
    tensors = [
        torch.randn(3, 2, generator=generator),
        torch.randn(5, generator=generator).to(torch.bfloat16),
        torch.empty(0, 4, dtype=torch.float32),
        torch.tensor([True, False, True]),
        torch.arange(3, dtype=torch.int64),
        torch.tensor(2.5, dtype=torch.float16),
        wide[:, 1:4],  # not contiguous
        torch.arange(5, dtype=torch.uint8),
    ]
    pieces = tuple(
        Piece(0, f"t{i}", (0,) * tensor.dim(), tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        for i, tensor in enumerate(tensors)
    )
    buffer = pack(pieces, tensors)
    assert buffer.dtype == torch.uint8 and buffer.numel() == packed_offsets(pieces)[1]
    unpacked = unpack(pieces, buffer)
    assert len(unpacked) == len(tensors)
    for original, restored in zip(tensors, unpacked):
        assert restored.dtype == original.dtype and restored.shape == original.shape
        assert torch.equal(restored, original)


def test_pack_of_nothing_is_an_empty_buffer():
    assert pack((), []).numel() == 0
    empty = Piece(0, "e", (0, 0), (0, 3), "float32")
    assert unpack((empty,), pack((empty,), [torch.empty(0, 3)]))[0].shape == (0, 3)


def plan_of(name, full, pieces):
    dtype = str(full.dtype).removeprefix("torch.")
    return TensorPlan(name, name, tuple(full.shape), dtype, dtype, tuple(pieces))


def test_assemble_uneven_pieces_along_dim_0():
    full = torch.randn(7, 3).to(torch.bfloat16)
    offsets = [0, 3, 6, 7]  # torch.chunk of 7 rows over 3: 3, 3, 1
    pieces = [Piece(rank, "w", (start, 0), (stop - start, 3), "bfloat16") for rank, (start, stop) in enumerate(zip(offsets, offsets[1:]))]
    assert [piece.shape[0] for piece in pieces] == [len(chunk) for chunk in full.chunk(3)]
    plan = plan_of("w", full, pieces)
    assembled = assemble(plan, {piece: piece_region(full, piece).clone() for piece in pieces})
    assert assembled.dtype == torch.bfloat16
    assert torch.equal(assembled, full)


def test_assemble_with_an_empty_piece():
    full = torch.arange(12, dtype=torch.int64).reshape(4, 3)
    pieces = [Piece(0, "w", (0, 0), (0, 3), "int64"), Piece(1, "w", (0, 0), (4, 3), "int64")]
    assembled = assemble(plan_of("w", full, pieces), {piece: piece_region(full, piece).clone() for piece in pieces})
    assert torch.equal(assembled, full)


def test_assemble_a_2d_split():
    full = torch.randn(5, 7)
    pieces = [
        Piece(rank, "w", (row, col), (rows, cols), "float32")
        for rank, ((row, rows), (col, cols)) in enumerate(
            [((0, 3), (0, 4)), ((0, 3), (4, 3)), ((3, 2), (0, 4)), ((3, 2), (4, 3))]
        )
    ]
    assembled = assemble(plan_of("w", full, pieces), {piece: piece_region(full, piece).clone() for piece in pieces})
    assert torch.equal(assembled, full)


# --- the real gather over gloo ---------------------------------------------------------------


def test_output_chunks_are_the_pieces_of_a_row_sharded_tensor():
    full = torch.randn(7, 3)
    pieces = [Piece(rank, "w", (start, 0), (stop - start, 3), "float32") for rank, (start, stop) in enumerate([(3, 6), (0, 3), (6, 7)])]
    plan = plan_of("w", full, pieces)
    chunks = output_chunks(plan, {piece: piece_region(full, piece) for piece in pieces})
    assert [chunk.shape[0] for chunk in chunks] == [3, 3, 1]  # in row order, no assembled copy
    assert all(chunk.data_ptr() == piece_region(full, piece).data_ptr() for chunk, piece in zip(chunks, sorted(pieces, key=lambda p: p.offset)))
    column = [Piece(rank, "w", (0, start), (7, stop - start), "float32") for rank, (start, stop) in enumerate([(0, 2), (2, 3)])]
    (assembled,) = output_chunks(plan_of("w", full, column), {piece: piece_region(full, piece).clone() for piece in column})
    assert torch.equal(assembled, full)


# --- the GPU a worker drives, and its staging buffers ------------------------------------------


def test_runs_across_rows_are_assembled_into_their_places_and_streamed_without_a_copy():
    """A ZeRO-partitioned weight: runs of its flattened elements, cutting through rows; the
    writer gets the runs themselves, in order, not an assembled copy of them."""
    full = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    runs = [(0, 4), (4, 4), (8, 4), (12, 3)]
    pieces = tuple(Piece(rank, "w", (start,), (length,), "float32") for rank, (start, length) in enumerate(runs))
    plan = TensorPlan(name="w", source_key="w", shape=(5, 3), source_dtype="float32", dtype="bfloat16", pieces=pieces)
    values = {piece: full.view(-1)[piece.offset[0]:piece.offset[0] + piece.shape[0]].clone() for piece in pieces}
    assert torch.equal(assemble(plan, values), full)
    shuffled = dict(reversed(values.items()))
    chunks = output_chunks(plan, shuffled)
    assert [chunk.data_ptr() for chunk in chunks] == [values[piece].data_ptr() for piece in pieces]
    assert torch.equal(torch.cat(chunks), full.view(-1))
