"""The export's Ray actors. Worker 0 is the exporter: it receives every bucket and writes DST.

Each worker reads only the rank files assigned to it, memory-mapped, and keeps them open until
the transfer is done.
"""

from __future__ import annotations

import hashlib
import logging
import resource
import shutil
import tempfile
import time
from typing import Any

import torch
from tqdm import tqdm

from rayexport import transport
from rayexport.dtypes import dtype_of
from rayexport.layouts.dcp import DcpCheckpoint, read_tensors
from rayexport.layouts.hf import SafetensorsTensors
from rayexport.layouts.verl import ShardInfo, VerlCheckpoint, describe_tensor, load_rank_state, local_tensor
from rayexport.plan import BASE_MODEL_RANK, Bucket, Piece, ShardFile, TensorPlan
from rayexport.storage import Store
from rayexport.writer import tensor_bytes, write_shards

log = logging.getLogger(__name__)


def peak_rss_bytes() -> int:
    """This process's peak resident memory (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class ExportWorker:
    """One member of the export's process group (a Ray actor)."""

    def __init__(self, index: int, num_workers: int, device: str, log_level: str) -> None:
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
        self.index = index
        self.num_workers = num_workers
        self.device = torch.device(device)
        self.spool_dir = tempfile.mkdtemp(prefix=f"rayexport-worker{index}-")
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.rendezvous = None
        self.bytes_read = 0

    def open_rendezvous(self, timeout_s: float) -> tuple[str, int]:
        """Worker 0 only: open the process group's store; return where others reach it."""
        import ray

        host = ray.util.get_node_ip_address()
        self.rendezvous = transport.open_rendezvous(host, timeout_s)
        return host, self.rendezvous.port

    def join_group(self, backend: str, host: str, port: int, timeout_s: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        transport.join_group(
            backend, self.index, self.num_workers, host, port, timeout_s, store=self.rendezvous
        )

    def load(
        self, source: Store, checkpoint: VerlCheckpoint, ranks: list[int], unsafe_pickle: bool = False
    ) -> dict[int, dict[str, ShardInfo]]:
        """Load this worker's rank files; describe what each holds."""
        infos = {}
        for rank in ranks:
            name = checkpoint.rank_files[rank]
            state = load_rank_state(source, name, self.spool_dir, unsafe_pickle)
            self.bytes_read += source.size(name)
            self.states[rank] = state
            infos[rank] = {key: describe_tensor(value, rank) for key, value in state.items()}
        return infos

    def load_dcp(
        self, source: Store, checkpoint: DcpCheckpoint, keys: list[str], unsafe_pickle: bool = False
    ) -> dict[int, dict[str, ShardInfo]]:
        """Read whole tensors of a DCP checkpoint, held as this worker's pseudo-rank."""
        tensors = read_tensors(source, checkpoint, keys, self.spool_dir, unsafe_pickle=unsafe_pickle)
        self.states[self.index] = tensors
        self.bytes_read += sum(checkpoint.tensors[key].nbytes for key in keys)
        return {self.index: {key: describe_tensor(value, self.index) for key, value in tensors.items()}}

    def load_base_model(self, base_model: Store) -> dict[str, ShardInfo]:
        """Exporter only: open a base model folder's weights as the pseudo-rank BASE_MODEL_RANK."""
        tensors = SafetensorsTensors(base_model, self.spool_dir)
        self.states[BASE_MODEL_RANK] = tensors
        return tensors.describe()

    def tied_differences(self, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
        """Max |canonical - alias| over this worker's shards, per pair of source keys."""
        differences = {}
        for pair in pairs:
            worst = 0.0
            for rank, state in self.states.items():
                if rank == BASE_MODEL_RANK or pair[0] not in state or pair[1] not in state:
                    continue
                first, second = local_tensor(state[pair[0]]), local_tensor(state[pair[1]])
                if first.shape != second.shape:
                    worst = float("inf")
                elif first.numel():
                    worst = max(worst, (first.double() - second.double()).abs().max().item())
            differences[pair] = worst
        return differences

    def source_digests(self, requests: list[tuple[Piece, str]]) -> list[str]:
        """sha256 of each requested piece as this worker read it, cast to its output dtype: the
        verification's reference, taken before the data goes near the gather."""
        return [
            hashlib.sha256(tensor_bytes(self._local(piece).to(dtype_of(dtype)))).hexdigest()
            for piece, dtype in requests
        ]

    def send(self, buckets: list[Bucket]) -> dict[str, Any]:
        """A non-exporting worker's whole transfer: pack and send its pieces, bucket by bucket."""
        sent = 0
        for bucket in buckets:
            pieces = bucket.sends[self.index]
            if not pieces:
                continue
            buffer = transport.pack(pieces, [self._local(piece) for piece in pieces], self.device)
            transport.send_bucket(buffer)
            sent += buffer.numel()
        return self.stats(bytes_sent=sent)

    def export(
        self,
        buckets: list[Bucket],
        plans: dict[str, TensorPlan],
        file_groups: list[list[ShardFile]],
        destination: Store,
        carried: dict[str, bytes],
    ) -> dict[str, Any]:
        """The exporter's transfer: receive every bucket and write each group of safetensors
        files (the model's shards and index, then any adapter), then the small files the
        export carries (config, tokenizer, code); return every file's size and digest."""
        started = time.perf_counter()
        files, digests, written = {}, {}, []
        total = sum(plan.nbytes for plan in plans.values())
        with tqdm(total=total, unit="B", unit_scale=True, desc="export", mininterval=1.0) as progress:
            tensors = transport.gather_tensors(buckets, plans, self._local, self.device)
            for group in file_groups:
                group_written, group_digests = write_shards(destination, group, plans, tensors, progress.update)
                written += group_written
                digests.update(group_digests)
        for name, data in sorted(carried.items()):
            destination.write_bytes(name, data)
            files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for item in written:
            files[item.name] = {"size": item.size, "sha256": item.sha256}
        gathered = sum(transport.bucket_bytes(bucket) for bucket in buckets)
        seconds = time.perf_counter() - started
        log.info("wrote %d bytes in %.2f s (%.1f MB/s)", total, seconds, total / max(seconds, 1e-9) / 1e6)
        return {
            "files": files,
            "tensor_digests": digests,
            **self.stats(bytes_gathered=gathered, bytes_written=sum(item.size for item in written)),
        }

    def stats(self, **extra: int) -> dict[str, Any]:
        return {"worker": self.index, "bytes_read": self.bytes_read, "peak_rss_bytes": peak_rss_bytes(), **extra}

    def close(self) -> None:
        transport.leave_group()
        self.states.clear()
        shutil.rmtree(self.spool_dir, ignore_errors=True)

    def _local(self, piece: Piece) -> torch.Tensor:
        return local_tensor(self.states[piece.rank][piece.source_key])

