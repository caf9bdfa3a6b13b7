"""The export's workers on Ray: their placement (bundles, waits, the backend `placement` picks),
start (or a warm pool's idle group), every distributed step with fail-fast waits (one dead
worker ends the export at once), the verification task, and removal."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from huggingface_hub import StateDictSplit

from rayexport.errors import ExportError, one_line
from rayexport.layouts.dcp import DcpCheckpoint, assign_tensors
from rayexport.layouts.verl import VerlCheckpoint
from rayexport.options import ExportOptions
from rayexport.placement import Devices, choose_devices, missing_resources
from rayexport.plan.naming import TensorPlanning
from rayexport.plan.pieces import BASE_MODEL_RANK, Piece, holders_from_ranks, needed_ranks
from rayexport.plan.schedule import TransferPlan, assign_ranks, keep_ties_together
from rayexport.pool import IdleGroup, get_keeper, group_shape
from rayexport.storage import Store
from rayexport.verification import ExpectedExport, verify_export
from rayexport.workers import ExportWorker

log = logging.getLogger(__name__)


def _bundle_text(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in bundle.items()) + "}"


def _ensure_ray(options: ExportOptions) -> None:
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=options.log_level, log_to_driver=True)
    else:
        ray.init(include_dashboard=False, logging_level=options.log_level, log_to_driver=True)


def step_limit(options: ExportOptions, job_deadline: float) -> tuple[float, str]:
    """Seconds one step may take: --timeout, or less when the whole job's --deadline is nearer."""
    remaining = job_deadline - time.monotonic()
    deadline = f"--deadline {options.deadline_s:.0f} s for the whole export"
    if remaining <= 0:
        raise ExportError(f"export timed out: past its {deadline}")
    if remaining < options.timeout_s:
        return remaining, deadline
    return options.timeout_s, "--timeout"


def _actor_death(references: list, wait_s: float):
    """The first RayActorError among `references` that arrives within `wait_s`, else None."""
    import ray
    from ray.exceptions import RayActorError

    ready, _ = ray.wait(list(references), num_returns=len(references), timeout=wait_s)
    for reference in ready:
        try:
            ray.get(reference, timeout=0)
        except RayActorError as error:
            return error
        except Exception:  # noqa: BLE001 - other failures are reported by the caller
            continue
    return None


def _get(references: list, limit: tuple[float, str], on_failure) -> list:
    """Wait for every reference; on the first error or when the step's time `limit` (seconds,
    and the option that set it) runs out, call `on_failure` and raise, so one dead worker ends
    the export at once instead of leaving others blocked."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    timeout_s, source = limit
    deadline = time.monotonic() + timeout_s
    pending = list(references)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise GetTimeoutError(f"no answer within {timeout_s:.0f} s ({source})")
            ray.get(ready[0])
        return ray.get(list(references))
    except RayTaskError as error:
        cause = error.cause
        if isinstance(cause, ExportError):
            on_failure()
            raise type(cause)(*cause.args) from None
        # A worker whose peer died fails its collective ("connection closed by peer") and may
        # answer before the dead worker's own error does: name the death when it follows.
        died = _actor_death(references, wait_s=5)
        on_failure()
        if died is not None:
            raise ExportError(f"an export worker died: {died}".splitlines()[0]) from None
        raise ExportError(f"an export worker failed: {type(cause).__name__}: {one_line(cause)}") from None
    except RayActorError as error:
        on_failure()
        raise ExportError(f"an export worker died: {error}".splitlines()[0]) from None
    except GetTimeoutError as error:
        on_failure()
        raise ExportError(f"export timed out: {error}") from None


class WorkerGroup:
    """The export's placement group and actors; `shutdown()` removes both, or with a warm pool
    (`options.pool`) hands a healthy group back to the pool for the next export."""

    @classmethod
    def for_export(cls, options: ExportOptions, world_size: int, job_deadline: float) -> "WorkerGroup":
        """A group sized for the checkpoint and the cluster (joining or starting Ray), on the
        devices `choose_devices` picks from what is free now; not started yet."""
        import ray

        _ensure_ray(options)
        if options.workers is not None:
            size = min(options.workers, world_size)
        else:
            cpus = int(ray.cluster_resources().get("CPU", 1) // max(options.num_cpus_per_worker, 1e-9))
            size = max(1, min(world_size, cpus))
        devices = choose_devices(
            options.backend, options.num_gpus_per_worker, size,
            free_gpus=ray.available_resources().get("GPU", 0.0), total_gpus=ray.cluster_resources().get("GPU", 0.0),
        )
        log.info("%d worker(s) over %s: %s", size, devices.backend, devices.reason)
        return cls(size, devices, options, job_deadline)

    @staticmethod
    def verify(destination: Store, expected: ExpectedExport, options: ExportOptions, job_deadline: float) -> dict[str, Any]:
        """Check the written export in a separate Ray task (see `verify_export`)."""
        if expected.level == "none":
            return {"passed": None, "level": "none"}
        import ray

        task = ray.remote(num_cpus=1, max_retries=0)(verify_export)
        limit = step_limit(options, job_deadline)
        reference = task.remote(destination, expected, limit[0])
        return _get([reference], limit, on_failure=lambda: ray.cancel(reference, force=True))[0]

    def __init__(self, size: int, devices: Devices, options: ExportOptions, job_deadline: float) -> None:
        self.job_deadline = job_deadline
        self.size = size
        self.devices = devices
        self.options = options
        self.actors: list = []
        self.placement_group = None
        self.keeper = None
        self.reused = False

    @property
    def _lifetime(self) -> dict[str, str]:
        """Pooled actors and their placement group outlive the driver or task that started them."""
        return {"lifetime": "detached"} if self.options.pool else {}

    @property
    def shape(self) -> str:
        return group_shape(self.size, self.devices.backend, self.options.num_cpus_per_worker, self.devices.gpus_per_worker)

    def start(self) -> None:
        """Take an idle group from the warm pool if there is one of this shape, else start one:
        a placement group, the actors, and their process group."""
        if self.options.pool:
            import ray

            self.keeper = get_keeper(self.options.pool)
            idle = ray.get(self.keeper.take.remote(self.shape), timeout=self.options.timeout_s)
            if idle is not None:
                self.actors, self.placement_group = idle.actors, idle.placement_group
                try:
                    self._get([actor.reset.remote() for actor in self.actors])
                    self.reused = True
                    return
                except ExportError as error:  # a pooled worker died while idle: start afresh
                    log.warning("a pooled worker group of %s is gone (%s); starting a new one", self.options.pool, error)
        self._start_new()

    def _start_new(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._place()
        actor_class = ray.remote(ExportWorker)
        for index in range(self.size):
            self.actors.append(
                actor_class.options(
                    num_cpus=self.options.num_cpus_per_worker,
                    num_gpus=self.devices.gpus_per_worker,
                    max_restarts=0,
                    **self._lifetime,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement_group, placement_group_bundle_index=index
                    ),
                ).remote(index, self.size, self.options.log_level)
            )
        host, port = self._get([self.actors[0].open_rendezvous.remote(self.options.timeout_s)])[0]
        self._get([
            actor.join_group.remote(self.devices.backend, host, port, self.options.timeout_s) for actor in self.actors
        ])

    def _place(self) -> None:
        """Reserve a bundle per worker, waiting at most --placement-timeout. GPUs that `auto`
        saw free but that were taken meanwhile: gloo instead. Otherwise a bundle that cannot be
        placed in time ends the export with one line naming what is missing."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        gpus = self.devices.gpus_per_worker
        bundle = {"CPU": self.options.num_cpus_per_worker, **({"GPU": gpus} if gpus else {})}
        self.placement_group = placement_group([bundle] * self.size, strategy="PACK", **self._lifetime)
        wait_s = min(step_limit(self.options, self.job_deadline)[0], self.options.placement_timeout_s)
        if ray.wait([self.placement_group.ready()], timeout=wait_s)[0]:
            return
        remove_placement_group(self.placement_group)
        self.placement_group = None
        step_limit(self.options, self.job_deadline)  # past the job's deadline: say that
        if self.devices.fallback:
            self.devices = Devices("gloo", 0.0, f"the free GPUs were taken before the workers were placed ({self.devices.reason} at the start)")
            log.warning("%d worker(s) over gloo: %s", self.size, self.devices.reason)
            return self._place()
        raise ExportError(
            f"the Ray cluster cannot place {self.size} worker(s) of {_bundle_text(bundle)} within {wait_s:.0f} s "
            f"(--placement-timeout): "
            + missing_resources(bundle, self.size, ray.available_resources(), ray.cluster_resources())
        )

    def load(self, source: Store, checkpoint: VerlCheckpoint, ranks_by_worker: dict[int, list[int]]) -> dict:
        references = [
            self.actors[worker].load.remote(source, checkpoint, ranks, self.options.unsafe_pickle)
            for worker, ranks in ranks_by_worker.items() if ranks
        ]
        infos: dict = {}
        for part in self._get(references):
            infos.update(part)
        return infos

    def load_checkpoint(
        self, source: Store, checkpoint: VerlCheckpoint | DcpCheckpoint, aliases: dict[str, str]
    ) -> tuple[dict, dict, dict[int, int]]:
        """Have the workers load their share of the checkpoint. Returns what each (pseudo-)rank
        holds, the same per key, and which worker holds each rank.

        verl: rank 0's file (on worker 0) tells which ranks hold data not found elsewhere (HSDP
        replicas are skipped); those are spread over the workers. DCP: each worker reads a
        byte-balanced share of whole tensors, tied copies together."""
        if isinstance(checkpoint, DcpCheckpoint):
            assignment = keep_ties_together(assign_tensors(checkpoint, self.size), aliases)
            rank_infos = self.load_dcp(source, checkpoint, assignment)
            worker_of_rank = {worker: worker for worker in range(self.size)}
            holders = {key: {rank: infos[key]} for rank, infos in rank_infos.items() for key in infos}
        else:
            rank_infos = self.load(source, checkpoint, {0: [0]})
            ranks = needed_ranks(rank_infos[0], checkpoint.world_size)
            worker_of_rank = assign_ranks(ranks, self.size)
            rest: dict[int, list[int]] = {}
            for rank in ranks[1:]:
                rest.setdefault(worker_of_rank[rank], []).append(rank)
            rank_infos.update(self.load(source, checkpoint, rest))
            holders = holders_from_ranks(rank_infos)
        worker_of_rank[BASE_MODEL_RANK] = 0
        return rank_infos, holders, worker_of_rank

    def load_dcp(self, source: Store, checkpoint: DcpCheckpoint, keys_by_worker: list[list[str]]) -> dict:
        """Each worker reads its share of a DCP checkpoint's tensors; returns their descriptions
        keyed by worker (each worker is the pseudo-rank of what it read)."""
        references = [
            self.actors[worker].load_dcp.remote(source, checkpoint, keys, self.options.unsafe_pickle)
            for worker, keys in enumerate(keys_by_worker) if keys
        ]
        infos: dict = {}
        for part in self._get(references):
            infos.update(part)
        return infos

    def load_base_model(self, base_model: Store) -> dict:
        """The exporter opens the base model's safetensors; returns their descriptions."""
        return self._get([self.actors[0].load_base_model.remote(base_model)])[0]

    def tied_differences(self, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
        if not pairs:
            return {}
        differences = {pair: 0.0 for pair in pairs}
        for part in self._get([actor.tied_differences.remote(pairs) for actor in self.actors]):
            for pair, value in part.items():
                differences[pair] = max(differences[pair], value)
        return differences

    def source_pieces(self, planning: TensorPlanning, worker_of_rank: dict[int, int]) -> dict[str, list[dict]]:
        """Per output tensor, where each source piece goes and its digest after the planned
        cast, computed by the worker holding it (LoRA-merged tensors have no such pieces)."""
        requests: dict[int, list[tuple[Piece, str, str]]] = {}
        for plan in planning.tensors + planning.adapters:
            if plan.lora is None:
                for piece in plan.pieces:
                    requests.setdefault(worker_of_rank[piece.rank], []).append((piece, plan.dtype, plan.name))
        workers = sorted(requests)
        answers = self._get([
            self.actors[worker].source_digests.remote([(piece, dtype) for piece, dtype, _ in requests[worker]])
            for worker in workers
        ])
        pieces: dict[str, list[dict]] = {}
        for worker, digests in zip(workers, answers):
            for (piece, _, name), digest in zip(requests[worker], digests):
                pieces.setdefault(name, []).append({
                    "rank": piece.rank, "source_key": piece.source_key,
                    "offset": list(piece.offset), "shape": list(piece.shape), "sha256": digest,
                })
        return {name: sorted(records, key=lambda record: record["offset"]) for name, records in sorted(pieces.items())}

    def transfer(
        self, transfer: TransferPlan, plans: dict, split: StateDictSplit, destination: Store, carried: dict[str, bytes]
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Run the gather: every worker sends its pieces and writes its files; worker 0 also
        writes the index and the carried files. Returns (every file and tensor digest, stats
        per worker)."""
        results = self._get([
            actor.transfer.remote(transfer, plans, destination, split if index == 0 else None, carried if index == 0 else {})
            for index, actor in enumerate(self.actors)
        ])
        merged: dict[str, Any] = {"files": {}, "tensor_digests": {}}
        for result in results:
            result["files_written"] = sorted(result["files"])
            merged["files"].update(result.pop("files"))
            merged["tensor_digests"].update(result.pop("tensor_digests"))
        return merged, results

    def shutdown(self, graceful: bool = True) -> None:
        """Remove the actors (letting them leave the group and drop spooled files when
        `graceful`) and the placement group; with a warm pool, a graceful end instead resets
        the actors and returns the group to the pool."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if graceful and self.keeper is not None and self.actors:
            with contextlib.suppress(ExportError):
                self._get([actor.reset.remote() for actor in self.actors])
                ray.get(self.keeper.give.remote(self.shape, IdleGroup(self.actors, self.placement_group)))
                self.actors, self.placement_group = [], None
                return
        if graceful and self.actors:
            closing = [actor.close.remote() for actor in self.actors]
            ray.wait(closing, num_returns=len(closing), timeout=30)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self.actors = []
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
            self.placement_group = None

    def _get(self, references: list) -> list:
        return _get(references, step_limit(self.options, self.job_deadline), on_failure=lambda: self.shutdown(graceful=False))
