"""Transport: the process group and the bucketed, exact-size gather of shard pieces to rank 0.

Pieces are uneven (torch.chunk rule, possibly empty), so instead of a collective that needs
equal sizes, each worker packs its pieces of a bucket into one flat byte buffer whose size the
plan fixes in advance, and the bucket's writer (rank 0, or one of `--writers K`) receives each
buffer with a point-to-point recv of exactly that size. A writer's own pieces never leave its
process. Buffers come from a fixed window of staging slots (`Staging`), on the host for gloo and
pinned host plus GPU for NCCL.
"""

from __future__ import annotations

import collections
import datetime
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from rayexport.common.errors import ExportError
from rayexport.common.passes import Count, ignore
from rayexport.plan.naming import TensorPlan
from rayexport.plan.pieces import Piece
from rayexport.plan.schedule import WINDOW, Bucket, packed_offsets, staging_bytes, wire_bytes
from rayexport.transport.assembly import output_chunks, pack, unpack

T = TypeVar("T")


def open_rendezvous(host: str, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, on a port the OS picks (no port races); its `.port` is shared."""
    return dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def join_group(
    backend: str, rank: int, world_size: int, host: str, port: int, timeout_s: float,
    store: dist.TCPStore | None = None, device: torch.device | None = None,
) -> None:
    """Join the export's process group through rank 0's store; under NCCL, `device` binds the
    group to this worker's GPU."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device
    )


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def cuda_device(assigned_gpus: list, visible_devices: str | None) -> torch.device:
    """The GPU an NCCL worker drives: the first GPU Ray assigned it, counted among the devices
    the process can see. Ray narrows `CUDA_VISIBLE_DEVICES` to the actor's own GPUs, so that is
    `cuda:0`; where Ray leaves visibility alone, it is the assigned index itself; a process
    started without Ray (no assignment) drives the first device it sees."""
    if not assigned_gpus:
        return torch.device("cuda", 0)
    first = str(assigned_gpus[0])
    if not visible_devices:
        return torch.device("cuda", int(first))
    visible = [device.strip() for device in visible_devices.split(",")]
    if first not in visible:
        raise ExportError(f"GPU {first} assigned by Ray is not among CUDA_VISIBLE_DEVICES={visible_devices}")
    return torch.device("cuda", visible.index(first))


class _Slot:
    """One bucket's buffers: `host` is where bytes are packed and read (pinned when a GPU is
    used), `wire` what the process group sends from or receives into (`host` itself on the
    CPU, a buffer of the same size on the GPU)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=on_gpu)
        self.wire = torch.empty(capacity, dtype=torch.uint8, device=device) if on_gpu else self.host


@dataclass
class _Receiving:
    """A bucket's receives, posted into `slot`: each sender's pieces at their place in it."""

    slot: _Slot
    requests: list
    placed: list[tuple[tuple[Piece, ...], int, int]]
    size: int


class Staging:
    """The window's buffers: `size` slots allocated once and reused bucket after bucket, so a
    worker's memory for the gather (host, and GPU under NCCL) is `size` times its largest
    bucket, whatever the model's size. `count` gets the bytes it packs, sends and receives.

    How the order of the bytes is guaranteed (the host reads a received slot only once
    `receive` has returned, and reuses a sent one only once `finish_send` has):
    - gloo: the process group reads and writes the host buffer itself, and `Work.wait()`
      returns once it has.
    - NCCL: `Work.wait()` only makes the current CUDA stream wait for NCCL's stream, and the
      host goes on at once. So a send packs into the pinned host buffer, copies it to the GPU on
      this worker's own stream, makes the current stream wait for that copy before the send is
      queued (NCCL's stream waits on the current one); a receive makes this worker's stream
      wait for the current one (which waited for the receives) before copying the bytes back
      to the host, once. Each side ends by recording an event after the last of that work and
      blocking the host on it: only then is the slot's host buffer read, or the slot reused.
    """

    def __init__(self, device: torch.device, capacity: int, size: int = WINDOW, count: Count = ignore) -> None:
        self.device, self.count = device, count
        self.on_gpu = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.on_gpu else None
        self.free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        for _ in range(size):
            self.free.put(_Slot(capacity, device))
        self.sends: collections.deque[tuple[dist.Work, _Slot]] = collections.deque()

    def acquire(self, writer_failed: Callable[[], bool]) -> _Slot | None:
        """A free slot, finishing the oldest send first when none is; None if the writer failed.
        A received bucket holds its slot until it is written, a sent one until it has left."""
        while not writer_failed():
            try:
                return self.free.get(block=not self.sends, timeout=None if self.sends else 0.2)
            except queue.Empty:
                if self.sends:
                    self.finish_send()
        return None

    def release(self, slot: _Slot) -> None:
        self.free.put(slot)

    def send(self, slot: _Slot, pieces: tuple[Piece, ...], tensors: list[torch.Tensor], writer: int) -> None:
        """Pack `tensors` into the slot and start sending them to `writer`; the slot comes back
        once the send has left it (`finish_send`)."""
        size = pack(pieces, tensors, into=slot.host).numel()
        self.count("read", sum(piece.nbytes for piece in pieces))
        for kind in ("copied", "sent"):  # packed, then sent, with the alignment's padding
            self.count(kind, size)
        self.to_wire(slot, size)
        self.sends.append((dist.isend(slot.wire[:size], dst=writer), slot))

    def finish_send(self) -> None:
        """Wait until the oldest send has left its slot's buffers, then free the slot."""
        work, slot = self.sends.popleft()
        work.wait()
        if self.on_gpu:
            self._block_host(torch.cuda.current_stream(self.device))
        self.release(slot)

    def post_receive(self, slot: _Slot, bucket: Bucket, rank: int) -> _Receiving:
        """Start receiving every other worker's pieces of `bucket` into the slot, concurrently;
        `finish_receive` waits for them."""
        requests, placed, position = [], [], 0
        for worker, pieces in enumerate(bucket.sends):
            if worker == rank or not pieces:
                continue
            size = packed_offsets(pieces)[1]
            if size:  # a worker whose pieces are all empty sends nothing
                requests.append(dist.irecv(slot.wire[position:position + size], src=worker))
            placed.append((pieces, position, size))
            position += size
        return _Receiving(slot, requests, placed, position)

    def finish_receive(self, receiving: _Receiving) -> dict[Piece, torch.Tensor]:
        """Wait for a posted receive; returns views of the pieces in the slot's host buffer."""
        for request in receiving.requests:
            request.wait()
        self.count("received", receiving.size)
        self.to_host(receiving.slot, receiving.size)
        received = {}
        for pieces, start, size in receiving.placed:
            received.update(zip(pieces, unpack(pieces, receiving.slot.host[start:start + size])))
        return received

    def to_wire(self, slot: _Slot, size: int) -> None:
        """The first `size` packed bytes, copied to the GPU on this worker's stream; work queued
        on the current stream after this (the send) waits for the copy. Nothing on the CPU."""
        if self.on_gpu and size:
            with torch.cuda.stream(self.stream):
                slot.wire[:size].copy_(slot.host[:size], non_blocking=True)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def to_host(self, slot: _Slot, size: int) -> None:
        """The first `size` received bytes, copied once to the host after the work queued on
        the current stream (the receives); returns when they are there. Nothing on the CPU."""
        if self.on_gpu and size:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                slot.host[:size].copy_(slot.wire[:size], non_blocking=True)
            self._block_host(self.stream)

    def _block_host(self, stream: torch.cuda.Stream) -> None:
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()


def run_transfer(
    rank: int,
    buckets: tuple[Bucket, ...],
    plans: dict[str, TensorPlan],
    local_pieces: Callable[[tuple[Piece, ...]], list[torch.Tensor]],
    device: torch.device,
    write: Callable[[Iterator[tuple[str, list[torch.Tensor]]]], T] | None,
    window: int = WINDOW,
    after_read: Callable[[], None] = lambda: None,
    sent: Callable[[int], None] = lambda count: None,
    count: Count = ignore,
) -> T | None:
    """This worker's part of the gather, stepping through the buckets in the planned order.

    It packs and sends its pieces of other writers' buckets (packing bucket k+1 while bucket k
    is on the wire, or while its own bucket k arrives: `worker_steps`) and receives its own
    buckets, whose tensors go, in order, to `write` running in a thread, so receiving bucket
    k+1 overlaps writing bucket k. At most `window` buckets are held at once (see `Staging`).
    `after_read` runs once a bucket's source bytes have been packed or written (to give back
    mapped pages), `sent` with the bytes of each bucket this worker has sent, `count` with
    those of each pass. Returns what `write` returns (None when this worker writes nothing)."""
    staging = Staging(device, staging_bytes(buckets, rank), window, count)
    writing = _WriterThread(write, plans, staging, after_read, count, rank) if write is not None else None
    writer_failed = writing.failed if writing is not None else lambda: False

    def send(bucket: Bucket) -> bool:
        """Pack and start sending this worker's pieces of another writer's bucket; False if the
        writer failed first."""
        if (slot := staging.acquire(writer_failed)) is None:
            return False
        pieces = bucket.sends[rank]
        staging.send(slot, pieces, local_pieces(pieces), bucket.writer)
        after_read()
        sent(wire_bytes(bucket, rank))
        return True

    try:
        for bucket, ahead in worker_steps(buckets, rank, window):
            if bucket.writer != rank:
                if not send(bucket):
                    break
                continue
            if (slot := staging.acquire(writer_failed)) is None:
                break
            receiving = staging.post_receive(slot, bucket, rank)
            if ahead is not None and not send(ahead):
                break
            pieces = staging.finish_receive(receiving)
            pieces.update(zip(bucket.sends[rank], local_pieces(bucket.sends[rank])))
            count("read", sum(piece.nbytes for piece in bucket.sends[rank]))
            writing.ready.put((bucket, slot, pieces))
            del pieces, receiving
        while staging.sends and not writer_failed():
            staging.finish_send()
    finally:
        if writing is not None:
            writing.close()
    return writing.result() if writing is not None else None


class _WriterThread:
    """The writer's thread: the tensors of each received bucket (`ready`, in order, None at the
    end) go to `write`, each bucket's slot back to the staging once written. A failure is kept
    for the main thread, which stops at its next step (`failed`) and raises it (`result`)."""

    def __init__(
        self, write: Callable[[Iterator[tuple[str, list[torch.Tensor]]]], T], plans: dict[str, TensorPlan],
        staging: Staging, after_read: Callable[[], None], count: Count, rank: int,
    ) -> None:
        self.ready: queue.Queue = queue.Queue()
        self.write, self.plans, self.staging, self.after_read, self.count = write, plans, staging, after_read, count
        self.outcome: dict[str, Any] = {}
        self.holding: list[_Slot] = []  # the slot of the bucket the writer is on
        self.thread = threading.Thread(target=self._run, name=f"rayexport-writer{rank}", daemon=True)
        self.thread.start()

    def _outputs(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        while (item := self.ready.get()) is not None:
            bucket, slot, pieces = item
            self.holding.append(slot)
            held = {id(tensor) for tensor in pieces.values()}
            for name in bucket.tensors:
                chunks = output_chunks(self.plans[name], pieces)
                self.count("copied", sum(chunk.nbytes for chunk in chunks if id(chunk) not in held))  # assembled
                yield name, chunks
            del item, pieces
            self.staging.release(self.holding.pop())
            self.after_read()

    def _run(self) -> None:
        try:
            self.outcome["result"] = self.write(self._outputs())
        except BaseException as error:  # handed to the main thread, which raises it
            self.outcome["error"] = error
        if self.holding:  # the writer is done with the last bucket it took
            self.staging.release(self.holding.pop())

    def failed(self) -> bool:
        return "error" in self.outcome

    def close(self) -> None:
        """No more buckets: wait for the thread to write what it has."""
        self.ready.put(None)
        self.thread.join()

    def result(self) -> Any:
        """What `write` returned, or its error raised here."""
        if self.failed():
            raise self.outcome["error"]
        return self.outcome.get("result")


def worker_steps(
    buckets: tuple[Bucket, ...], rank: int, window: int = WINDOW,
) -> Iterator[tuple[Bucket, Bucket | None]]:
    """What `rank` does, bucket by bucket in the planned order: each bucket it writes (receives),
    with the next bucket when that is another writer's and `rank` sends to it (sent while this
    one arrives, in a second slot of the window: its writer, which is sending this one, is then
    not kept waiting for `rank`'s bytes of the next); and each other bucket it sends to, not
    sent ahead, as (bucket, None)."""
    sent_ahead = -1
    for position, bucket in enumerate(buckets):
        if bucket.writer == rank:
            following = buckets[position + 1] if position + 1 < len(buckets) else None
            if window > 1 and following is not None and following.writer != rank and wire_bytes(following, rank):
                sent_ahead = position + 1
                yield bucket, following
            else:
                yield bucket, None
        elif position != sent_ahead and wire_bytes(bucket, rank):
            yield bucket, None
