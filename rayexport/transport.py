"""Transport: the process group and the bucketed, exact-size gather of shard pieces to rank 0.

Pieces are uneven (torch.chunk rule, possibly empty), so instead of a collective that needs
equal sizes, each worker packs its pieces of a bucket into one flat byte buffer whose size the
plan fixes in advance, and rank 0 receives each buffer with a point-to-point recv of exactly
that size. Rank 0's own pieces never leave its process.
"""

from __future__ import annotations

import datetime
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rayexport.lora import merge_lora
from rayexport.dtypes import dtype_of
from rayexport.plan import Bucket, Piece, TensorPlan, packed_offsets


def open_rendezvous(host: str, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, on a port the OS picks (no port races); its `.port` is shared."""
    return dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def join_group(
    backend: str, rank: int, world_size: int, host: str, port: int, timeout_s: float,
    store: dist.TCPStore | None = None,
) -> None:
    """Join the export's process group through rank 0's store."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def pack(pieces: tuple[Piece, ...], tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Copy the local tensors of `pieces` into one aligned byte buffer."""
    offsets, size = packed_offsets(pieces)
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
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


def send_bucket(buffer: torch.Tensor) -> None:
    """A worker's side of one bucket: its whole packed buffer to rank 0."""
    if buffer.numel():
        dist.send(buffer, dst=0)


def receive_bucket(bucket: Bucket, device: torch.device) -> dict[Piece, torch.Tensor]:
    """Rank 0's side of one bucket: every other worker's buffer, received concurrently."""
    requests, buffers = [], {}
    for worker, pieces in enumerate(bucket.sends):
        if worker == 0 or not pieces:
            continue
        buffer = torch.empty(packed_offsets(pieces)[1], dtype=torch.uint8, device=device)
        if buffer.numel():  # mirrors send_bucket, which sends nothing for an empty buffer
            requests.append(dist.irecv(buffer, src=worker))
        buffers[worker] = buffer
    for request in requests:
        request.wait()
    received = {}
    for worker, buffer in buffers.items():
        pieces = bucket.sends[worker]
        received.update(zip(pieces, unpack(pieces, buffer.cpu())))
    return received


def assemble(plan: TensorPlan, pieces: dict[Piece, torch.Tensor]) -> torch.Tensor:
    """The full tensor from its pieces, each copied to its offset (in the source dtype)."""
    if len(plan.pieces) == 1 and plan.pieces[0].shape == plan.shape:
        return pieces[plan.pieces[0]]
    full = torch.empty(plan.shape, dtype=dtype_of(plan.source_dtype))
    for piece in plan.pieces:
        region = tuple(slice(start, start + length) for start, length in zip(piece.offset, piece.shape))
        full[region] = pieces[piece]
    return full


def assemble_output(plan: TensorPlan, pieces: dict[Piece, torch.Tensor]) -> torch.Tensor:
    """An output tensor: assembled, with its LoRA adapter merged when the plan says so."""
    tensor = assemble(plan, pieces)
    if plan.lora is None:
        return tensor
    a, b = assemble(plan.lora.a, pieces), assemble(plan.lora.b, pieces)
    return merge_lora(tensor, a, b, plan.lora.scale)


def gather_tensors(
    buckets: list[Bucket],
    plans: dict[str, TensorPlan],
    local_piece: Callable[[Piece], torch.Tensor],
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank 0: yield each output tensor, bucket by bucket, as the gather completes it.
    `local_piece(piece)` returns a piece this process holds itself."""
    for bucket in buckets:
        pieces = receive_bucket(bucket, device)
        for piece in bucket.sends[0]:
            pieces[piece] = local_piece(piece)
        for name in bucket.tensors:
            yield name, assemble_output(plans[name], pieces)
        del pieces


def bucket_bytes(bucket: Bucket) -> int:
    return sum(packed_offsets(pieces)[1] for pieces in bucket.sends)

