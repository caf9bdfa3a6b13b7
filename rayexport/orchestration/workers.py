"""The export's Ray actors. Each reads only the rank files assigned to it, memory-mapped, and
gives back the pages it has read after each step, so that its memory stays at the transfer
window whatever the size of its files. The writers among them (every worker by default) each
write their share of the output files; worker 0, the exporter, also the index, config,
tokenizer and code."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import time
from typing import Any, Callable

import torch
from huggingface_hub import StateDictSplit

from rayexport.common.dtypes import dtype_of
from rayexport.common.errors import ExportError
from rayexport.common.levels import reads_whole_files
from rayexport.common.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from rayexport.common.passes import Count, Passes
from rayexport.common.scan import max_abs_difference, scan_and_digest
from rayexport.layouts import registry  # noqa: F401 - each layout's Checkpoint arrives pickled: imported at start, not in a load
from rayexport.layouts.base import Checkpoint, Part
from rayexport.layouts.dcp_chunks import REQUESTS_IN_FLIGHT
from rayexport.layouts.mapped import release_pages
from rayexport.orchestration import spool
from rayexport.orchestration.progress import WorkerProgress
from rayexport.orchestration.worker_reports import WorkerStats, WorkerTransfer
from rayexport.plan.lora import merge_lora
from rayexport.plan.naming import TensorPlan
from rayexport.plan.pieces import BASE_MODEL_RANK, Piece
from rayexport.plan.schedule import TransferPlan, received_bytes, sent_bytes
from rayexport.plan.shards import ShardInfo, local_tensor
from rayexport.storage.store import Store
from rayexport.transport import gather
from rayexport.transport.writer import WrittenFile, write_index, write_shards, written_bytes
from rayexport.verification.consumers import discard_prepared, prepare_consumer_checks, run_consumer_checks
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.files import FileCheck, check_files

log = logging.getLogger(__name__)

# A worker started without an export id (benchmarks/gpu_check.py, tests) makes one of its own,
# as for an export this long from its deadline.
STANDALONE_SPOOL_S = 86400.0


def _running_ray():
    """The ray module when this process belongs to a Ray session; None where Ray is not
    installed or not started (a worker run without Ray, as benchmarks/gpu_check.py does)."""
    try:
        import ray
    except ImportError:
        return None
    return ray if ray.is_initialized() else None


def _assigned_gpus() -> list:
    """The GPU ids Ray assigned this actor ([] outside Ray)."""
    ray = _running_ray()
    return list(ray.get_gpu_ids()) if ray else []


def _node_id() -> str:
    """This worker's Ray node id, or its host name outside Ray."""
    ray = _running_ray()
    return ray.get_runtime_context().get_node_id() if ray else socket.gethostname()


def run_on_gpus(check: Any, gpus: float, destination: Store, *arguments: Any) -> dict[str, Any]:
    """A consumer check that asks for `gpus` (the vLLM check), as a Ray task holding them where
    the cluster has that many, on this node when the export is on this node's own disk; on a
    cluster without them (or outside Ray) it runs here, on CPU."""
    ray = _running_ray()
    if ray is None or ray.cluster_resources().get("GPU", 0) < gpus:
        return check.run(destination, *arguments)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(_node_id(), soft=False) if destination.is_local else "DEFAULT"
    task = ray.remote(_run_check).options(num_cpus=0, num_gpus=gpus, scheduling_strategy=here)
    return ray.get(task.remote(check, destination, *arguments))


def _run_check(check: Any, *arguments: Any) -> dict[str, Any]:
    """The check in a Ray task: its result, and the GPUs Ray gave the task."""
    import ray

    return {**check.run(*arguments), "ray_gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()]}


class ExportWorker:
    """One member of the export's process group (in a Ray actor, `ExportWorkerActor`). `cpus`: the CPUs it reserved,
    torch's threads in it (None: torch's default); `check_cpus`: those the export's workers
    hold on its node, which worker 0's consumer checks use once the export is written."""

    def __init__(
        self, index: int, num_workers: int, log_level: str, export_id: str | None = None, cpus: float | None = None,
        check_cpus: float = 1.0,
    ) -> None:
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
        if cpus is not None:  # Ray's OMP_NUM_THREADS comes too late where torch was imported ahead (a local Ray)
            torch.set_num_threads(max(1, int(cpus)))
        self.check_cpus = max(1, int(check_cpus))
        self.index = index
        self.num_workers = num_workers
        self.device = torch.device("cpu")  # the GPU under NCCL, once it joins the group
        self.spool_dir: str | None = None
        self._begin_spool(export_id or spool.new_export_id(STANDALONE_SPOOL_S))
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.mapped: list[tuple[int, int]] = []
        self.rendezvous = None
        self.bytes_read = 0
        self.earlier_peak_rss = 0
        self.resident_before_load: int | None = None
        self.prepared_checks: dict[str, Any] = {}
        self.progress_counts = WorkerProgress()
        self.passes = Passes()

    def prepare_checks(self) -> None:
        """Worker 0: start what the consumer checks start ahead (the reload's process), so that
        their imports overlap the export, or, in a warm pool, are done before it starts."""
        if not self.prepared_checks:
            self.prepared_checks = prepare_consumer_checks(cpus=self.check_cpus)

    def consumer_checks(self, destination: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int) -> dict:
        """Worker 0: run the consumer checks on the written export (each in a process of its
        own, see `rayexport.verification.consumers`), with what `prepare_checks` started."""
        prepared, self.prepared_checks = self.prepared_checks, {}
        return run_consumer_checks(destination, expected, timeout_s, memory_bound_bytes, prepared=prepared, gpu_runner=run_on_gpus)

    def open_rendezvous(self, timeout_s: float, host: str | None = None) -> tuple[str, int]:
        """Worker 0 only: open the process group's store on `host` (default: this Ray node's
        address); return where others reach it."""
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        self.rendezvous = gather.open_rendezvous(host, timeout_s)
        return host, self.rendezvous.port

    def join_group(self, backend: str, host: str, port: int, timeout_s: float) -> None:
        """Join the export's process group; under NCCL, first take this worker's own GPU."""
        if backend == "nccl":
            self.device = self._take_gpu()
        gather.join_group(
            backend, self.index, self.num_workers, host, port, timeout_s, store=self.rendezvous,
            device=self.device if backend == "nccl" else None,
        )

    def _take_gpu(self) -> torch.device:
        gpus = _assigned_gpus()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if not torch.cuda.is_available():
            raise ExportError(
                f"worker {self.index} was placed for NCCL (Ray GPU ids {gpus}, CUDA_VISIBLE_DEVICES={visible}) "
                f"but torch finds no CUDA device on {socket.gethostname()}"
            )
        device = gather.cuda_device(gpus, visible)
        torch.cuda.set_device(device.index)
        return device

    def load(self, checkpoint: Checkpoint, part: Part) -> dict[int, dict[str, ShardInfo]]:
        """Read this worker's `part` of the checkpoint, as its layout reads it (see
        `Checkpoint.read`), memory-mapped; describe what each (pseudo-)rank holds. Mapped files'
        values are first read by the source scan, in the transfer or ahead of it."""
        self._start_measuring()
        total = checkpoint.part_bytes(part)
        infos = {}
        if checkpoint.spools_remote_files and not checkpoint.store.is_local:
            self.progress_counts.expect("spooled", total)
        self.progress_counts.expect("loaded", total)
        loaded = self.progress_counts.counter("loaded")
        for rank, tensors in checkpoint.read(part, self.spool_dir, self.progress_counts.counter("spooled")).items():
            self.states[rank] = tensors
            self.mapped += [span for span in tensors.mapped_ranges() if span not in self.mapped]  # files shared by ranks once
            infos[rank] = tensors.describe(loaded)
        self.bytes_read += total
        spooled, count = self.progress_counts.done["spooled"], self.passes.counter("load")
        if spooled:
            count("read", spooled)
            count("written", spooled)
        return infos

    def tied_differences(self, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
        """Max |canonical - alias| per pair of source keys, over the (pseudo-)ranks of this
        worker that hold both; a pair this worker holds no such rank of is left out."""
        differences: dict[tuple[str, str], float] = {}
        for pair in pairs:
            for rank, state in self.states.items():
                if rank == BASE_MODEL_RANK or pair[0] not in state or pair[1] not in state:
                    continue
                difference = max_abs_difference(local_tensor(state[pair[0]]), local_tensor(state[pair[1]]))
                differences[pair] = max(differences.get(pair, 0.0), difference)
                self.release_pages()
        return differences

    def scan_ahead(self, requests: list[tuple[Piece, str | None, tuple | None]]) -> list[tuple[bool, str | None]]:
        """The scan ahead of the transfer (`rayexport.orchestration.references.scan_ahead`): one
        pass over each requested piece as this worker read it, a chunk at a time, giving whether
        its values are finite and, given its output dtype, the digest of its bytes cast to it
        (the verification's reference, taken before the data goes near the gather). A piece of a
        LoRA-merged weight comes with its adapter, the arguments of `merge_lora` after W (A, B,
        scale, fan_in_fan_out), and is merged here a block of rows at a time."""
        count, scanned = self.passes.counter("source_scan"), self.progress_counts.counter("scanned")
        self.progress_counts.expect("scanned", sum(piece.nbytes for piece, _, _ in requests))
        results = []
        for piece, dtype, adapter in requests:
            values = self._local(piece)
            count("read", values.nbytes)
            blocks = [values] if adapter is None else merge_lora(values, *adapter, offset=piece.offset)
            results.append(scan_and_digest(blocks, dtype_of(dtype) if dtype is not None else None, count))
            scanned(piece.nbytes)
            self.release_pages()
        return results

    def _scanning_reader(
        self, wanted: dict[Piece, str | None], found: dict[Piece, tuple[bool, str | None]], count: Count
    ) -> Callable[[tuple[Piece, ...]], list[torch.Tensor]]:
        """The transfer's reader of this worker's pieces of a bucket: each piece in `wanted` is
        scanned (and digested in the dtype given) as it is first read, its result put in
        `found`, so the bytes it pulls from storage are the ones then packed or written, from
        the page cache (or, fetched from object storage, from memory)."""
        scanned = self.progress_counts.counter("scanned")

        def read(pieces: tuple[Piece, ...]) -> list[torch.Tensor]:
            all_values = self._local_all(pieces)
            for piece, values in zip(pieces, all_values):
                if piece in wanted and piece not in found:
                    dtype = wanted[piece]
                    found[piece] = scan_and_digest([values], dtype_of(dtype) if dtype is not None else None, count)
                    scanned(piece.nbytes)
            return all_values

        return read

    def read_pieces(self, pieces: list[Piece]) -> list[torch.Tensor]:
        """Copies of pieces this worker holds (LoRA halves, for the verification's reference)."""
        copies = [self._local(piece).clone() for piece in pieces]
        self.release_pages()
        return copies

    def transfer(
        self,
        transfer: TransferPlan,
        plans: dict[str, TensorPlan],
        destination: Store,
        index: StateDictSplit | None,
        carried: dict[str, bytes],
        sha256: bool = False,
        scan: dict[Piece, str | None] | None = None,
    ) -> WorkerTransfer:
        """This worker's part of the gather: send its pieces, and write the output files
        `transfer` gives it; worker 0 then writes the index of the model's files (`index`, the
        shard split) and the small files the export carries (config, tokenizer, code). With
        `sha256`, each file's SHA-256 is recorded beside its digest. The pieces in `scan` that
        this worker sends or writes are scanned as they are read (see `_scanning_reader`)."""
        started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        my_files = transfer.files[self.index]
        total = sum(plans[name].nbytes for shard in my_files for name in shard.tensors)
        self.progress_counts.expect("written", total)
        self.progress_counts.expect("sent", sent_bytes(transfer.buckets, self.index))
        mine = {piece for bucket in transfer.buckets for piece in bucket.sends[self.index]}
        wanted = {piece: dtype for piece, dtype in (scan or {}).items() if piece in mine}
        self.progress_counts.expect("scanned", sum(piece.nbytes for piece in wanted))

        count = self.passes.counter("transfer")
        scanned: dict[Piece, tuple[bool, str | None]] = {}
        read = self._scanning_reader(wanted, scanned, count)

        def write(tensors) -> tuple[list[WrittenFile], dict[str, str]]:
            return write_shards(destination, my_files, plans, tensors, self.progress_counts.counter("written"), sha256, count)

        written, digests = gather.run_transfer(
            self.index, transfer.buckets, plans, read, self.device,
            write if my_files else None, after_read=self.release_pages, sent=self.progress_counts.counter("sent"),
            count=count,
        ) or ([], {})
        read(tuple(wanted.keys() - scanned.keys()))  # pieces the gather never reads: the empty ones
        index_file = write_index(destination, index, sha256) if index is not None else None
        files = {item.name: item.record() for item in written + ([index_file] if index_file else [])}
        for name, data in sorted(carried.items()):
            destination.write_bytes(name, data)
            files[name] = written_bytes(name, data, sha256).record()
        seconds = time.perf_counter() - started
        if total:
            log.info("worker %d wrote %d bytes in %.2f s (%.1f MB/s)", self.index, total, seconds, total / max(seconds, 1e-9) / 1e6)
        stats = self.stats()
        stats.bytes_received = received_bytes(transfer.buckets, self.index)
        stats.files_written = sorted(files)
        return WorkerTransfer(files, digests, stats, scanned)

    def check_files(self, destination: Store, names: list[str], expected: ExpectedExport) -> list[FileCheck]:
        """Re-read files this worker wrote from the destination and check them (see
        `rayexport.verification.files.check_files`), counting the bytes read."""
        if reads_whole_files(expected.level):
            self.progress_counts.expect("verified", sum(expected.files[name]["size"] for name in names))
        return check_files(destination, names, expected, self.progress_counts.counter("verified"), self.passes.counter("verify_files"))

    def progress(self) -> WorkerProgress:
        """This export's bytes done and expected so far (asked by the driver for its bar, from a
        thread of its own while the other methods run)."""
        return self.progress_counts.snapshot()

    def stats(self) -> WorkerStats:
        """Where this worker runs, the bytes it read and its memory so far (see `WorkerStats`)."""
        peak = peak_rss_bytes()
        return WorkerStats(
            worker=self.index, node=_node_id(), pid=os.getpid(), device=str(self.device),
            bytes_read=self.bytes_read, peak_rss_bytes=max(self.earlier_peak_rss, peak),
            working_memory_bytes=peak - self.resident_before_load if self.resident_before_load is not None else None,
            peak_gpu_bytes=torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None,
            passes=self.passes.snapshot(),
        )

    def _start_measuring(self) -> None:
        if self.resident_before_load is None:
            self.earlier_peak_rss = peak_rss_bytes()
            if reset_peak_rss():
                self.resident_before_load = rss_bytes()

    def release_pages(self) -> None:
        """Give back the pages of the mapped rank files read so far (they stay cached)."""
        release_pages(self.mapped)

    def reset(self, export_id: str | None = None, checks: bool = False) -> None:
        """Forget the last export (a pooled worker waiting for the next one): its tensors, mapped
        files, counters and spooled files; given the next export's id, start that export's spool
        folder; with `checks`, have the consumer checks' processes ready (`prepare_checks`).
        The process group stays."""
        if checks:
            self.prepare_checks()
        self.states.clear()
        self.mapped = []
        self.bytes_read = 0
        self.progress_counts = WorkerProgress()
        self.passes = Passes()
        self.resident_before_load = None
        self._drop_spool()
        if export_id is not None:
            self._begin_spool(export_id)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the staging slots' GPU memory, cached by torch's allocator

    def close(self) -> None:
        gather.leave_group()
        discard_prepared(self.prepared_checks)
        self.states.clear()
        self._drop_spool()

    def _begin_spool(self, export_id: str) -> None:
        """Sweep the spool folders on this node that dead workers or exports left, then make this
        worker's folder for `export_id` (see rayexport.orchestration.spool)."""
        root = spool.spool_root()
        for path in spool.sweep(root):
            log.info("worker %d removed the stale spool folder %s", self.index, path)
        self.spool_dir = spool.make_worker_folder(root, export_id, self.index)

    def _drop_spool(self) -> None:
        if self.spool_dir is not None:
            spool.remove_worker_folder(self.spool_dir)
            self.spool_dir = None

    def _local(self, piece: Piece) -> torch.Tensor:
        return self.states[piece.rank].values(piece)

    def _local_all(self, pieces: tuple[Piece, ...]) -> list[torch.Tensor]:
        """Each of `pieces`, those fetched from object storage (`SourceTensors.fetches`) several
        at once."""
        if len(pieces) < 2 or not any(self.states[piece.rank].fetches for piece in pieces):
            return [self._local(piece) for piece in pieces]
        with concurrent.futures.ThreadPoolExecutor(REQUESTS_IN_FLIGHT) as pool:
            return list(pool.map(self._local, pieces))
