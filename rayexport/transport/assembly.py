"""Pieces of tensors put together: pieces packed into one aligned byte buffer for the wire and
viewed back out of it, and an output tensor assembled from its pieces (or streamed as consecutive
chunks, LoRA merged). A rank's piece is cut from its local shard by `plan.pieces.piece_tensor`."""

from __future__ import annotations

from typing import TYPE_CHECKING
from rayexport.common.dtypes import dtype_of
from rayexport.plan.lora import merge_lora
from rayexport.plan.naming import TensorPlan
from rayexport.plan.pieces import Piece, is_run, placed
from rayexport.plan.schedule import packed_offsets

if TYPE_CHECKING:
    import torch


def pack(pieces: tuple[Piece, ...], tensors: list[torch.Tensor], into: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the local tensors of `pieces` into one aligned byte buffer: the start of `into`
    (a host buffer at least that large), or a new one; returns the packed bytes."""
    import torch

    offsets, size = packed_offsets(pieces)
    buffer = torch.empty(size, dtype=torch.uint8) if into is None else into[:size]
    for offset, piece, tensor in zip(offsets, pieces, tensors):
        buffer[offset:offset + piece.nbytes].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
    return buffer


def unpack(pieces: tuple[Piece, ...], buffer: torch.Tensor) -> list[torch.Tensor]:
    """Views of each piece in a received buffer."""
    offsets, _ = packed_offsets(pieces)
    return [
        buffer[offset:offset + piece.nbytes].view(dtype_of(piece.dtype)).reshape(piece.shape)
        for offset, piece in zip(offsets, pieces)
    ]


def assemble(plan: TensorPlan, pieces: dict[Piece, torch.Tensor]) -> torch.Tensor:
    """The full tensor from its pieces, each copied to its offset (in the source dtype); a run
    of the flattened tensor (`is_run`) to its place in the flattened tensor."""
    if len(plan.pieces) == 1 and plan.pieces[0].shape == plan.shape:
        return pieces[plan.pieces[0]]
    import torch

    full = torch.empty(plan.shape, dtype=dtype_of(plan.source_dtype))
    for piece in plan.pieces:
        if is_run(piece, plan.shape):
            full.view(-1)[piece.offset[0]:piece.offset[0] + piece.shape[0]] = pieces[piece]
            continue
        full[placed(piece)] = pieces[piece]
    return full


def output_chunks(plan: TensorPlan, pieces: dict[Piece, torch.Tensor]) -> list[torch.Tensor]:
    """An output tensor as consecutive chunks whose bytes, in order, are the tensor's bytes.

    Pieces that are whole rows (Shard(0), FSDP1 flat rows) or runs of the flattened tensor
    (ZeRO's partitions, which together cover it in order) are written as they are, with no
    assembled copy; anything else (boxes) is assembled, and a LoRA adapter is merged when
    planned."""
    if plan.lora is not None:
        a, b = assemble(plan.lora.a, pieces), assemble(plan.lora.b, pieces)
        return list(merge_lora(assemble(plan, pieces), a, b, plan.lora.scale, plan.lora.fan_in_fan_out))
    if plan.shape and all(is_run(piece, plan.shape) for piece in plan.pieces):
        return [pieces[piece] for piece in sorted(plan.pieces, key=lambda piece: piece.offset[0]) if piece.shape[0]] or [
            assemble(plan, pieces)
        ]
    whole_rows = all(
        not is_run(piece, plan.shape) and not piece.placement_steps and piece.offset[1:] == (0,) * (len(plan.shape) - 1)
        and piece.shape[1:] == plan.shape[1:]
        for piece in plan.pieces
    )
    if not whole_rows or not plan.shape:
        return [assemble(plan, pieces)]
    ordered = sorted(plan.pieces, key=lambda piece: piece.offset[0])
    return [pieces[piece] for piece in ordered if piece.shape[0]] or [assemble(plan, pieces)]
