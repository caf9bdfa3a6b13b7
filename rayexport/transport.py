"""Transport: the process group and the bucketed, exact-size gather of shard pieces to rank 0.

Pieces are uneven (torch.chunk rule, possibly empty), so instead of a collective that needs
equal sizes, each worker packs its pieces of a bucket into one flat byte buffer whose size the
plan fixes in advance, and the bucket's writer (rank 0, or one of `--writers K`) receives each
buffer with a point-to-point recv of exactly that size. A writer's own pieces never leave its
process.
"""

from __future__ import annotations

import collections
import datetime
import queue
import threading
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from rayexport.dtypes import dtype_of
from rayexport.lora import merge_lora
from rayexport.plan import Bucket, Piece, TensorPlan, packed_offsets

T = TypeVar("T")
# Buckets in flight per worker: one being written (or sent) while the next is received (or packed).
WINDOW = 2


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


def receive_bucket(bucket: Bucket, device: torch.device) -> dict[Piece, torch.Tensor]:
    """The writer's side of one bucket: every other worker's buffer, received concurrently."""
    requests, buffers = [], {}
    for worker, pieces in enumerate(bucket.sends):
        if worker == bucket.writer or not pieces:
            continue
        buffer = torch.empty(packed_offsets(pieces)[1], dtype=torch.uint8, device=device)
        if buffer.numel():  # a worker whose pieces are all empty sends nothing
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


def output_chunks(plan: TensorPlan, pieces: dict[Piece, torch.Tensor]) -> list[torch.Tensor]:
    """An output tensor as consecutive chunks whose bytes, in order, are the tensor's bytes.

    Pieces that are whole rows (Shard(0), FSDP1 flat rows) are written as they are, with no
    assembled copy; anything else is assembled, and a LoRA adapter is merged when planned."""
    if plan.lora is not None:
        a, b = assemble(plan.lora.a, pieces), assemble(plan.lora.b, pieces)
        return [merge_lora(assemble(plan, pieces), a, b, plan.lora.scale)]
    whole_rows = all(
        piece.offset[1:] == (0,) * (len(plan.shape) - 1) and piece.shape[1:] == plan.shape[1:]
        for piece in plan.pieces
    )
    if not whole_rows or not plan.shape:
        return [assemble(plan, pieces)]
    ordered = sorted(plan.pieces, key=lambda piece: piece.offset[0])
    return [pieces[piece] for piece in ordered if piece.shape[0]] or [assemble(plan, pieces)]


class _Window:
    """At most `size` bucket buffers held by this worker at once: a received bucket holds a
    slot until it is written, a sent one until its writer has received it."""

    def __init__(self, size: int) -> None:
        self.slots = threading.Semaphore(size)
        self.sends: collections.deque = collections.deque()

    def acquire(self, writer_failed: Callable[[], bool]) -> bool:
        """Wait for a slot (finishing the oldest send first); False if the writer failed."""
        while not writer_failed():
            if self.slots.acquire(blocking=not self.sends, timeout=None if self.sends else 0.2):
                return True
            if self.sends:
                self.finish_send()
        return False

    def send(self, buffer: torch.Tensor, writer: int) -> None:
        self.sends.append((dist.isend(buffer, dst=writer), buffer))

    def finish_send(self) -> None:
        work, _ = self.sends.popleft()
        work.wait()
        self.slots.release()

    def release(self) -> None:
        self.slots.release()


def run_transfer(
    rank: int,
    buckets: tuple[Bucket, ...],
    plans: dict[str, TensorPlan],
    local_piece: Callable[[Piece], torch.Tensor],
    device: torch.device,
    write: Callable[[Iterator[tuple[str, list[torch.Tensor]]]], T] | None,
    window: int = WINDOW,
    after_read: Callable[[], None] = lambda: None,
) -> T | None:
    """This worker's part of the gather, stepping through the buckets in the planned order.

    It packs and sends its pieces of other writers' buckets (packing bucket k+1 while bucket k
    is on the wire) and receives its own buckets, whose tensors go, in order, to `write`
    running in a thread, so receiving bucket k+1 overlaps writing bucket k. `after_read` runs
    once a bucket's source bytes have been packed or written (to give back mapped pages).
    Returns what `write` returns (None when this worker writes nothing)."""
    ready: queue.Queue = queue.Queue()
    slots = _Window(window)
    outcome: dict[str, Any] = {}
    holding = []

    def outputs() -> Iterator[tuple[str, list[torch.Tensor]]]:
        while (item := ready.get()) is not None:
            bucket, pieces = item
            holding.append(True)
            for name in bucket.tensors:
                yield name, output_chunks(plans[name], pieces)
            del item, pieces
            holding.pop()
            after_read()
            slots.release()

    def writer() -> None:
        try:
            outcome["result"] = write(outputs())
        except BaseException as error:  # handed to the main thread, which raises it
            outcome["error"] = error
        if holding:  # the writer is done with the last bucket it took
            slots.release()

    def writer_failed() -> bool:
        return "error" in outcome

    thread = None
    if write is not None:
        thread = threading.Thread(target=writer, name=f"rayexport-writer{rank}", daemon=True)
        thread.start()
    try:
        for bucket in buckets:
            if bucket.writer == rank:
                if not slots.acquire(writer_failed):
                    break
                pieces = receive_bucket(bucket, device)
                pieces.update((piece, local_piece(piece)) for piece in bucket.sends[rank])
                ready.put((bucket, pieces))
                del pieces
            elif packed_offsets(bucket.sends[rank])[1]:
                if not slots.acquire(writer_failed):
                    break
                pieces = bucket.sends[rank]
                slots.send(pack(pieces, [local_piece(piece) for piece in pieces], device), bucket.writer)
                after_read()
        while slots.sends and not writer_failed():
            slots.finish_send()
    finally:
        ready.put(None)
        if thread is not None:
            thread.join()
    if writer_failed():
        raise outcome["error"]
    return outcome.get("result")


def received_bytes(buckets: tuple[Bucket, ...], rank: int) -> int:
    """Bytes `rank` receives over the network in the gather (its own pieces never travel)."""
    return sum(
        packed_offsets(pieces)[1]
        for bucket in buckets if bucket.writer == rank
        for worker, pieces in enumerate(bucket.sends) if worker != rank
    )
