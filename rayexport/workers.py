"""The export's Ray actors. Worker 0 is the exporter: it writes the output files (with
`--writers K`, workers 0..K-1 each write their own share of them) plus the index, config,
tokenizer and code.

Each worker reads only the rank files assigned to it, memory-mapped, keeps them open until the
transfer is done, and gives back the pages it has read after each step, so that its memory
stays at the transfer window whatever the size of its files.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import time
from typing import Any, Callable, Iterator

import torch
from huggingface_hub import StateDictSplit
from tqdm import tqdm

from rayexport import spool, transport
from rayexport.dtypes import dtype_of
from rayexport.errors import ExportError
from rayexport.layouts.dcp import DcpCheckpoint, read_tensors
from rayexport.layouts.hf import SafetensorsTensors
from rayexport.layouts.mapped import mapped_ranges, release_pages
from rayexport.layouts.shards import ShardInfo, describe_tensor, local_tensor
from rayexport.layouts.verl import VerlCheckpoint, load_rank_state
from rayexport.lora import merge_lora
from rayexport.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from rayexport.plan.naming import TensorPlan
from rayexport.plan.pieces import BASE_MODEL_RANK, Piece
from rayexport.plan.schedule import TransferPlan
from rayexport.scan import max_abs_difference
from rayexport.storage import Store
from rayexport.verification import ExpectedExport, FileCheck, check_files
from rayexport.writer import WrittenFile, tensor_bytes, write_index, write_shards

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


@contextlib.contextmanager
def progress_bar(total: int | None, description: str) -> Iterator[Callable[[int], Any]]:
    """A bar of bytes done, with rate and ETA; yields its update function. Inside Ray, the
    driver prints a worker's bar as lines of that worker's output (Ray's tqdm support redraws
    bars in place, which runs them into the driver's own one-line error messages)."""
    with tqdm(total=total, unit="B", unit_scale=True, desc=description, mininterval=1.0) as bar:
        yield bar.update


class ExportWorker:
    """One member of the export's process group (a Ray actor)."""

    def __init__(self, index: int, num_workers: int, log_level: str, export_id: str | None = None) -> None:
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
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

    def open_rendezvous(self, timeout_s: float, host: str | None = None) -> tuple[str, int]:
        """Worker 0 only: open the process group's store on `host` (default: this Ray node's
        address); return where others reach it."""
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        self.rendezvous = transport.open_rendezvous(host, timeout_s)
        return host, self.rendezvous.port

    def join_group(self, backend: str, host: str, port: int, timeout_s: float) -> None:
        """Join the export's process group; under NCCL, first take this worker's own GPU."""
        if backend == "nccl":
            self.device = self._take_gpu()
        transport.join_group(
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
        device = transport.cuda_device(gpus, visible)
        torch.cuda.set_device(device.index)
        return device

    def load(
        self, source: Store, checkpoint: VerlCheckpoint, ranks: list[int], unsafe_pickle: bool = False
    ) -> dict[int, dict[str, ShardInfo]]:
        """Load this worker's rank files; describe what each holds."""
        self._start_measuring()
        infos = {}
        sizes = {rank: source.size(checkpoint.rank_files[rank]) for rank in ranks}
        with contextlib.ExitStack() as bars:
            # a remote rank file is first spooled to local disk (rayexport.layouts.verl)
            spooled = (lambda count: None) if source.is_local else bars.enter_context(
                progress_bar(sum(sizes.values()), f"spool{self.index}")
            )
            advance = bars.enter_context(progress_bar(sum(sizes.values()), f"load{self.index}"))
            for rank in ranks:
                state, path = load_rank_state(source, checkpoint.rank_files[rank], self.spool_dir, unsafe_pickle, spooled)
                self.bytes_read += sizes[rank]
                self.states[rank] = state
                self.mapped += mapped_ranges(path)
                infos[rank] = {}
                # each tensor's share of the file, so the bar ends at the files' bytes
                scale = sizes[rank] / max(1, sum(local_tensor(value).nbytes for value in state.values()))
                for key, value in state.items():
                    infos[rank][key] = describe_tensor(value, rank)
                    advance(round(local_tensor(value).nbytes * scale))
                    self.release_pages()
        return infos

    def load_dcp(
        self, source: Store, checkpoint: DcpCheckpoint, keys: list[str], unsafe_pickle: bool = False
    ) -> dict[int, dict[str, ShardInfo]]:
        """Read whole tensors of a DCP checkpoint into this worker's spool file, memory-mapped,
        and hold them as this worker's pseudo-rank."""
        self._start_measuring()
        tensors = read_tensors(source, checkpoint, keys, self.spool_dir, unsafe_pickle=unsafe_pickle)
        self.states[self.index] = tensors
        self.mapped += tensors.mapped_ranges()
        self.bytes_read += sum(checkpoint.tensors[key].nbytes for key in keys)
        return {self.index: tensors.describe()}

    def load_base_model(self, base_model: Store) -> dict[str, ShardInfo]:
        """Exporter only: open a base model folder's weights as the pseudo-rank BASE_MODEL_RANK."""
        self._start_measuring()
        tensors = SafetensorsTensors(base_model, self.spool_dir)
        self.states[BASE_MODEL_RANK] = tensors
        return tensors.describe()

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

    def source_digests(self, requests: list[tuple[Piece, str, tuple | None]]) -> list[str]:
        """sha256 of each requested piece as this worker read it, cast to its output dtype: the
        verification's reference, taken before the data goes near the gather. A piece of a
        LoRA-merged weight comes with its adapter, the arguments of `merge_lora` after W (A, B,
        scale, fan_in_fan_out), and is merged here a block of rows at a time."""
        digests = []
        for piece, dtype, adapter in requests:
            values = self._local(piece)
            digest = hashlib.sha256()
            for chunk in [values] if adapter is None else merge_lora(values, *adapter, offset=piece.offset):
                digest.update(tensor_bytes(chunk.to(dtype_of(dtype))))
            digests.append(digest.hexdigest())
            self.release_pages()
        return digests

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
    ) -> dict[str, Any]:
        """This worker's part of the gather: send its pieces, and write the output files
        `transfer` gives it; worker 0 then writes the index of the model's files (`index`, the
        shard split) and the small files the export carries (config, tokenizer, code). Returns
        every file it wrote, with size and digest, each tensor's digest, and its bytes and memory."""
        started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        my_files = transfer.files[self.index]
        total = sum(plans[name].nbytes for shard in my_files for name in shard.tensors)

        def write(tensors) -> tuple[list[WrittenFile], dict[str, str]]:
            with progress_bar(total, f"write{self.index}") as advance:
                return write_shards(destination, my_files, plans, tensors, advance)

        written, digests = transport.run_transfer(
            self.index, transfer.buckets, plans, self._local, self.device,
            write if my_files else None, after_read=self.release_pages,
        ) or ([], {})
        index_file = write_index(destination, index) if index is not None else None
        files = {
            item.name: {"size": item.size, "sha256": item.sha256} for item in written + ([index_file] if index_file else [])
        }
        for name, data in sorted(carried.items()):
            destination.write_bytes(name, data)
            files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        seconds = time.perf_counter() - started
        if total:
            log.info("worker %d wrote %d bytes in %.2f s (%.1f MB/s)", self.index, total, seconds, total / max(seconds, 1e-9) / 1e6)
        received = transport.received_bytes(transfer.buckets, self.index)
        return {
            "files": files,
            "tensor_digests": digests,
            **self.stats(bytes_received=received, bytes_written=sum(item.size for item in written)),
        }

    def check_files(self, destination: Store, names: list[str], expected: ExpectedExport) -> list[FileCheck]:
        """Re-read files this worker wrote from the destination and check them (see
        `rayexport.verification.check_files`), with a progress bar of the bytes read."""
        whole = expected.level != "quick"
        total = sum(expected.files[name]["size"] for name in names) if whole else None
        with progress_bar(total, f"verify{self.index}") as advance:
            return check_files(destination, names, expected, advance)

    def stats(self, **extra: int) -> dict[str, Any]:
        """Bytes read, whole-life peak memory, and the working memory: the peak above what this
        process held before it loaded anything (None where Linux's peak reset is missing); on a
        GPU, the most GPU memory the last transfer held."""
        peak = peak_rss_bytes()
        working = peak - self.resident_before_load if self.resident_before_load is not None else None
        return {
            "worker": self.index, "node": _node_id(), "pid": os.getpid(), "device": str(self.device),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None,
            "bytes_read": self.bytes_read,
            "peak_rss_bytes": max(self.earlier_peak_rss, peak), "working_memory_bytes": working, **extra,
        }

    def _start_measuring(self) -> None:
        if self.resident_before_load is None:
            self.earlier_peak_rss = peak_rss_bytes()
            if reset_peak_rss():
                self.resident_before_load = rss_bytes()

    def release_pages(self) -> None:
        """Give back the pages of the mapped rank files read so far (they stay cached)."""
        release_pages(self.mapped)

    def reset(self, export_id: str | None = None) -> None:
        """Forget the last export (a pooled worker waiting for the next one): its tensors, mapped
        files, counters and spooled files; given the next export's id, start that export's spool
        folder. The process group stays."""
        self.states.clear()
        self.mapped = []
        self.bytes_read = 0
        self.resident_before_load = None
        self._drop_spool()
        if export_id is not None:
            self._begin_spool(export_id)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the staging slots' GPU memory, cached by torch's allocator

    def close(self) -> None:
        transport.leave_group()
        self.states.clear()
        self._drop_spool()

    def _begin_spool(self, export_id: str) -> None:
        """Sweep the spool folders on this node that dead workers or exports left, then make this
        worker's folder for `export_id` (see rayexport.spool)."""
        root = spool.spool_root()
        for path in spool.sweep(root):
            log.info("worker %d removed the stale spool folder %s", self.index, path)
        self.spool_dir = spool.make_worker_folder(root, export_id, self.index)

    def _drop_spool(self) -> None:
        if self.spool_dir is not None:
            spool.remove_worker_folder(self.spool_dir)
            self.spool_dir = None

    def _local(self, piece: Piece) -> torch.Tensor:
        return piece_tensor(local_tensor(self.states[piece.rank][piece.source_key]), piece)


def piece_tensor(local: torch.Tensor, piece: Piece) -> torch.Tensor:
    """What `piece` takes from a rank's local shard: all of it, or for a converted tensor its
    region laid out along the output's axes."""
    if piece.region is None:
        return local
    region = local[tuple(slice(start, start + length) for start, length in piece.region)]
    kept = [axis for axis in piece.axes if axis is not None]
    dropped = [axis for axis in range(region.dim()) if axis not in kept]  # unit extent
    return region.permute(kept + dropped).reshape(piece.shape)

