"""The export's workers on Ray: their placement (bundles, waits, the backend `placement` picks),
start (or a warm pool's idle group), every distributed step with fail-fast waits (one dead
worker ends the export at once, see `rayexport.orchestration.waits`), the consumer checks on worker 0, and
removal."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from huggingface_hub import StateDictSplit

from rayexport.common.errors import ExportError
from rayexport.common.levels import resolved, runs_checks
from rayexport.layouts.base import Checkpoint, Loaded, Part, count_part_bytes
from rayexport.orchestration import spool
from rayexport.orchestration.failure import lost_worker_line, remove_spool_on
from rayexport.orchestration.nodes import ClusterNodes, first_reader_node
from rayexport.orchestration.options import ExportOptions
from rayexport.orchestration.placement import (
    Devices, NodePlacement, bundle_text, choose_devices, group_size, missing_resources, pin_writers, place_by_files,
)
from rayexport.orchestration.pool import IdleGroup, get_keeper, group_shape
from rayexport.orchestration.progress import WorkerProgress
from rayexport.orchestration.session import ensure_ray
from rayexport.orchestration.waits import all_succeed, get_all, step_limit
from rayexport.orchestration.worker_actor import ExportWorkerActor
from rayexport.orchestration.worker_reports import WorkerStats
from rayexport.plan.pieces import Piece
from rayexport.plan.schedule import TransferPlan
from rayexport.storage.store import Store
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.files import FileCheck

log = logging.getLogger(__name__)

# Worker 0's thread for the consumer checks, so that they run while it checks its files.
CHECKS_GROUP = "consumer-checks"
# Each worker's thread that answers the driver's progress bar while its other methods run.
PROGRESS_GROUP = "progress"
# How long the bar waits for the workers' counters before it skips one refresh.
PROGRESS_ASK_S = 2.0
@dataclass
class Transferred:
    """What the gather wrote: every file (size, digests), each tensor's digest, each worker's
    stats (bytes, memory, where it ran, the files it wrote), and what the workers scanned of the
    pieces as they read them (each piece's finiteness and digest)."""

    files: dict[str, dict[str, Any]]
    tensor_digests: dict[str, str]
    worker_stats: list[WorkerStats]
    scanned: dict[Piece, tuple[bool, str | None]] = field(default_factory=dict)

    @property
    def bytes_written(self) -> int:
        return sum(record["size"] for record in self.files.values())


class WorkerGroup:
    """The export's placement group and actors; `shutdown()` removes both, or with a warm pool
    (`options.pool`) hands a healthy group back to the pool for the next export."""

    @staticmethod
    def connect(options: ExportOptions) -> None:  # join the Ray cluster or start one (`rayexport.orchestration.session`)
        ensure_ray(options.log_level)

    @classmethod
    def for_export(cls, options: ExportOptions, world_size: int, job_deadline: float) -> "WorkerGroup":
        """A group sized for the checkpoint and the cluster (joined already), on the devices
        `choose_devices` picks from what is free now; not started yet."""
        import ray

        size = group_size(options.workers, options.num_cpus_per_worker, world_size, ray.cluster_resources().get("CPU", 1))
        devices = choose_devices(
            options.backend, options.num_gpus_per_worker, size,
            free_gpus=ray.available_resources().get("GPU", 0.0), total_gpus=ray.cluster_resources().get("GPU", 0.0),
        )
        log.info("%d worker(s) over %s: %s", size, devices.backend, devices.reason)
        return cls(size, devices, options, job_deadline)

    def start_consumer_checks(self, destination: Store, expected: ExpectedExport) -> Any:
        """Worker 0 (on a local destination's node) starts the consumer checks, each in a process
        it started with the group, beside the file checks; `consumer_results` waits for them."""
        call = self.actors[0].consumer_checks.options(concurrency_group=CHECKS_GROUP)
        return call.remote(destination, expected, step_limit(self.options, self.job_deadline)[0], self.options.memory_bound_bytes)

    def consumer_results(self, started: Any) -> dict[str, dict[str, Any]]:
        return self._get([started])[0]  # each consumer check's result by its name

    def __init__(self, size: int, devices: Devices, options: ExportOptions, job_deadline: float) -> None:
        self.job_deadline = job_deadline
        self.size = size
        self.devices = devices
        self.options = options
        self.actors: list = []
        self.placement_group = None
        self.keeper = None
        self.reused = False
        self.nodes = NodePlacement((None,) * size)
        self.export_node: str | None = None  # the node whose disk a local destination is on, where there are several
        self.worker_node_ids: list[str | None] = []  # the Ray node each worker was placed on, once placed
        self.read_bytes: dict[int, int] = {}  # what each worker was given to read, by its parts (`Checkpoint.part_bytes`)
        # Names this export's spool folders on every node (rayexport.orchestration.spool).
        self.export_id = spool.new_export_id(job_deadline - time.monotonic())

    @property
    def _lifetime(self) -> dict[str, str]:
        """Pooled actors and their placement group outlive the driver or task that started them."""
        return {"lifetime": "detached"} if self.options.pool else {}

    @property
    def shape(self) -> str:
        shape = group_shape(self.size, self.devices.backend, self.options.num_cpus_per_worker, self.devices.gpus_per_worker)
        if self.nodes.pinned:
            shape += " on " + ",".join(node[:8] if node else "*" for node in self.nodes.worker_nodes)
        return shape

    @property
    def _verifies(self) -> bool:  # whether worker 0 starts the consumer checks' processes ahead
        return runs_checks(resolved(self.options.verify))

    @property
    def _bundle(self) -> dict[str, float]:
        gpus = self.devices.gpus_per_worker
        return {"CPU": self.options.num_cpus_per_worker, **({"GPU": gpus} if gpus else {})}

    def place_on_nodes(self, checkpoint: Checkpoint, cluster: ClusterNodes, export_node: str | None) -> None:
        """Pin the workers to nodes, before `start`: where the checkpoint's files are spread over
        nodes, each file is read on a node that holds it (at least one worker per such node,
        worker 0 reading the first file); a local destination (`export_node`) gets every writer.
        Logs, per node, the files it reads and the workers reading them."""
        self.export_node = export_node
        capacity = cluster.capacity(self._bundle)
        writers = self.options.writers
        if checkpoint.store.nowhere() is not None:  # files were looked for on every node: spread over them
            files = checkpoint.read_files()
            holders = {name: checkpoint.store.holders(name) for name in files}
            first_node = export_node or first_reader_node(checkpoint, cluster, self._bundle)
            # by default the files decide: every worker they put on the destination's node writes
            on_first = (writers or 1) if export_node is not None else 1
            self.nodes = place_by_files(files, holders, first_node, self.size, capacity, cluster.labels, on_first)
            for node in dict.fromkeys(self.nodes.worker_nodes):
                workers = [index for index, at in enumerate(self.nodes.worker_nodes) if at == node]
                read = sorted(name for name, worker in self.nodes.file_readers.items() if worker in workers)
                log.info("node %s: worker(s) %s read %s", cluster.labels[node], ", ".join(map(str, workers)), ", ".join(read))
        elif export_node is not None:
            self.nodes = pin_writers(export_node, self.size, writers or self.size, capacity)  # by default, all that fit
        else:
            return
        if len(self.nodes.worker_nodes) != self.size:
            log.info("%d worker(s) instead of %d, one or more on each node that holds files", len(self.nodes.worker_nodes), self.size)
            self.size = len(self.nodes.worker_nodes)

    @property
    def writers_limit(self) -> int | None:
        """How many workers may write (the first ones, pinned to a local destination's node); None: any."""
        return None if self.export_node is None else sum(node == self.export_node for node in self.nodes.worker_nodes)

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
                    self._get([
                        actor.reset.remote(self.export_id, checks=index == 0 and self._verifies)
                        for index, actor in enumerate(self.actors)
                    ])
                    self.reused = True
                    self.worker_node_ids = self._bundle_nodes()
                    return
                except ExportError as error:  # a pooled worker died while idle: start afresh
                    log.warning("a pooled worker group of %s is gone (%s); starting a new one", self.options.pool, error)
        self._start_new()

    def _start_new(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._place()
        self.worker_node_ids = self._bundle_nodes()
        actor_class = ray.remote(concurrency_groups={CHECKS_GROUP: 1, PROGRESS_GROUP: 1})(ExportWorkerActor)
        check_cpus = self.options.num_cpus_per_worker * self._workers_beside_first()
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
                ).remote(index, self.size, self.options.log_level, self.export_id, self.options.num_cpus_per_worker, check_cpus)
            )
        # worker 0 starts the reload's process first, so that its imports overlap all that follows
        preparing = [self.actors[0].prepare_checks.remote()] if self._verifies else []
        host, port = self._get(preparing + [self.actors[0].open_rendezvous.remote(self.options.timeout_s)])[-1]
        self._get([
            actor.join_group.remote(self.devices.backend, host, port, self.options.timeout_s) for actor in self.actors
        ])

    def _place(self) -> None:
        """Reserve a bundle per worker, waiting at most --placement-timeout. GPUs that `auto`
        saw free but that were taken meanwhile: gloo instead. Otherwise a bundle that cannot be
        placed in time ends the export with one line naming what is missing."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        bundle = self._bundle
        selectors = {}
        if self.nodes.pinned:
            selectors["bundle_label_selector"] = [{"ray.io/node-id": node} if node else {} for node in self.nodes.worker_nodes]
        self.placement_group = placement_group([bundle] * self.size, strategy="PACK", **selectors, **self._lifetime)
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
            f"the Ray cluster cannot place {self.size} worker(s) of {bundle_text(bundle)} within {wait_s:.0f} s "
            f"(--placement-timeout): "
            + missing_resources(bundle, self.size, ray.available_resources(), ray.cluster_resources())
        )

    def load(self, checkpoint: Checkpoint, aliases: dict[str, str]) -> Loaded:
        """Have the workers read their share of `checkpoint`, as its layout spreads it (see
        `Checkpoint.share`); `aliases` are the model's tied names, read together."""
        def step(parts: dict[int, Part]) -> dict:
            infos: dict = {}
            for part in self._get([self.actors[worker].load.remote(checkpoint, part) for worker, part in parts.items()]):
                infos.update(part)
            count_part_bytes(self.read_bytes, checkpoint, parts)
            return infos

        return checkpoint.share(self.size, aliases, step, self.nodes.file_readers)

    def tied_differences(self, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
        """Max |canonical - alias| per pair of source keys, over every worker that holds both;
        a pair no worker could compare is absent (never taken as equal)."""
        if not pairs:
            return {}
        differences: dict[tuple[str, str], float] = {}
        for part in self._get([actor.tied_differences.remote(pairs) for actor in self.actors]):
            for pair, value in part.items():
                differences[pair] = max(differences.get(pair, 0.0), value)
        return differences

    def ask(self, method: str, arguments: dict[int, tuple]) -> dict[int, Any]:
        """Call the worker method `method` on each worker in `arguments`, all at once, with its
        arguments there; each one's answer, by worker."""
        workers = sorted(arguments)
        answers = self._get([getattr(self.actors[worker], method).remote(*arguments[worker]) for worker in workers])
        return dict(zip(workers, answers))

    def transfer(
        self, transfer: TransferPlan, plans: dict, split: StateDictSplit, destination: Store, carried: dict[str, bytes],
        scan: dict[Piece, str | None],
    ) -> Transferred:
        """Run the gather: every worker sends its pieces and writes its files, scanning those of
        `scan` as it reads them; worker 0 also writes the index and the carried files."""
        results = self._get([
            actor.transfer.remote(
                transfer, plans, destination, split if index == 0 else None, carried if index == 0 else {},
                self.options.sha256, scan,
            )
            for index, actor in enumerate(self.actors)
        ])
        merged = Transferred(files={}, tensor_digests={}, worker_stats=[result.stats for result in results])
        for result in results:
            merged.files.update(result.files)
            merged.tensor_digests.update(result.tensor_digests)
            merged.scanned.update(result.scanned)
        return merged

    def check_files(self, destination: Store, expected: ExpectedExport, files_by_worker: dict[int, list[str]]) -> list[FileCheck]:
        """Each worker re-reads the files it wrote, all at once (see `ExportWorker.check_files`)."""
        answers = self._get([
            self.actors[worker].check_files.remote(destination, names, expected) for worker, names in sorted(files_by_worker.items()) if names
        ])
        return [check for checks in answers for check in checks]

    def progress_counts(self) -> list[WorkerProgress] | None:
        """Every worker's bytes done and expected now, for the driver's bar; None when a worker
        does not answer at once (the export's own steps notice a dead one)."""
        import ray

        try:
            calls = [actor.progress.options(concurrency_group=PROGRESS_GROUP).remote() for actor in self.actors]
            return ray.get(calls, timeout=PROGRESS_ASK_S)
        except Exception:  # noqa: BLE001 - a worker gone, busy or not yet started: no refresh this time
            return None

    def update_memory(self, worker_stats: list[WorkerStats]) -> None:
        """Bring each worker's peak and working memory, and its passes' bytes, up to now (after
        the verification too)."""
        for stats, now in zip(worker_stats, self._get([actor.stats.remote() for actor in self.actors])):
            stats.peak_rss_bytes, stats.working_memory_bytes = now.peak_rss_bytes, now.working_memory_bytes
            stats.passes = now.passes

    def shutdown(self, graceful: bool = True) -> None:
        """Remove the actors (letting them leave the group and drop spooled files when
        `graceful`) and the placement group; with a warm pool, a graceful end instead resets
        the actors and returns the group to the pool. Spooled files that no worker dropped
        (killed, dead, or not answering) are removed by a task on each node that ran one."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if graceful and self.keeper is not None and self.actors:
            with contextlib.suppress(ExportError):
                self._get([actor.reset.remote(checks=index == 0 and self._verifies) for index, actor in enumerate(self.actors)])
                ray.get(self.keeper.give.remote(self.shape, IdleGroup(self.actors, self.placement_group)))
                self.actors, self.placement_group = [], None
                return
        spool_left = bool(self.actors)
        if graceful and self.actors:
            spool_left = not all_succeed([actor.close.remote() for actor in self.actors], wait_s=30)
        nodes = self._worker_nodes() if spool_left else set()
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self.actors = []
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
            self.placement_group = None
        if nodes:
            remove_spool_on(nodes, self.export_id)

    def _workers_beside_first(self) -> int:
        """How many workers (worker 0 included) were placed on worker 0's node: whose CPUs the
        consumer checks, run there once the export is written, may use."""
        first = self.worker_node_ids[0] if self.worker_node_ids else None
        return sum(node == first for node in self.worker_node_ids) if first else 1

    def _bundle_nodes(self) -> list[str | None]:
        """The Ray node of each worker, as the placement group placed its bundle."""
        import ray

        try:
            placed = ray.util.placement_group_table(self.placement_group).get("bundles_to_node_id", {})
        except Exception:  # noqa: BLE001 - a group Ray no longer knows
            placed = {}
        return [placed.get(index) or None for index in range(self.size)]

    def _worker_nodes(self) -> set[str]:
        """The Ray nodes the workers were placed on."""
        return {node for node in self.worker_node_ids or self._bundle_nodes() if node}

    def _get(self, references: list) -> list:
        return get_all(
            references, step_limit(self.options, self.job_deadline), on_failure=lambda: self.shutdown(graceful=False),
            describe_death=lambda error: lost_worker_line(error, self.actors, self.worker_node_ids),
        )

