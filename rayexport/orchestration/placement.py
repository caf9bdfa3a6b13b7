"""Where the export's workers run: gloo on CPUs, or NCCL with a whole GPU per worker, decided
from what the Ray cluster can place when the export starts; and, when a placement cannot be
made, one line saying which resources are missing. Pure functions: the job passes in the
cluster's resources."""

from __future__ import annotations

from dataclasses import dataclass

from rayexport.common.errors import ExportError


@dataclass(frozen=True)
class Devices:
    """The workers' backend and the GPUs each reserves, with the reason, for the log and the
    report. `fallback`: `auto` picked NCCL only because GPUs were free; if they cannot be placed
    after all (taken meanwhile), the export runs on gloo instead of failing."""

    backend: str
    gpus_per_worker: float
    reason: str
    fallback: bool = False


def is_whole(gpus: float) -> bool:
    """Whether a GPU count is a whole, positive number of devices (what NCCL needs per rank)."""
    return gpus >= 1 and float(gpus).is_integer()


def choose_devices(
    backend: str, gpus_per_worker: float | None, num_workers: int, free_gpus: float, total_gpus: float
) -> Devices:
    """The backend and GPUs per worker for `--backend` and `--num-gpus-per-worker` (None: not
    given), given the cluster's free and total GPUs now.

    `auto` takes NCCL only when every worker finds a whole free GPU (free, not total: inside an
    RL job the trainer holds them); a fraction of a GPU, or `0`, means gloo. `nccl` with fewer
    GPUs in the whole cluster than it needs is refused here, before anything starts (options
    that can never suit NCCL, a fraction or 0, are refused by `ExportOptions`)."""
    per_worker = 1.0 if gpus_per_worker is None else float(gpus_per_worker)
    needed = num_workers * per_worker
    if backend == "gloo":
        return Devices("gloo", gpus_per_worker or 0.0, "--backend gloo")
    if backend == "nccl":
        if total_gpus < needed:
            raise ExportError(
                f"--backend nccl needs {needed:g} GPU(s) ({num_workers} worker(s) x {per_worker:g}); "
                f"the Ray cluster has {total_gpus:g}"
            )
        return Devices("nccl", per_worker, "--backend nccl")
    if gpus_per_worker == 0:
        return Devices("gloo", 0.0, "--num-gpus-per-worker 0 keeps the export off the GPUs")
    if not is_whole(per_worker):
        return Devices(
            "gloo", per_worker,
            f"--num-gpus-per-worker {per_worker:g} is a fraction of a GPU, and NCCL needs a whole GPU per worker",
        )
    if free_gpus >= needed:
        reason = f"{free_gpus:g} free GPU(s) for {num_workers} worker(s) x {per_worker:g}"
        return Devices("nccl", per_worker, reason, fallback=gpus_per_worker is None)
    if gpus_per_worker is None:
        if not total_gpus:
            return Devices("gloo", 0.0, "the Ray cluster has no GPUs")
        return Devices(
            "gloo", 0.0, f"{free_gpus:g} of the cluster's {total_gpus:g} GPU(s) free, {needed:g} needed for NCCL"
        )
    # GPUs were asked for and are not free now: wait for them (the placement names what is missing)
    return Devices("nccl", per_worker, f"--num-gpus-per-worker {per_worker:g}")


def bundle_text(bundle: dict[str, float]) -> str:
    """A worker's bundle as the messages name it: `{CPU: 1, GPU: 1}`."""
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in bundle.items()) + "}"


def missing_resources(bundle: dict[str, float], count: int, free: dict[str, float], total: dict[str, float]) -> str:
    """What keeps `count` bundles from being placed, for a one-line error: each resource with
    less free than needed, or, when every total would do, that no node has room for them."""
    short = [
        f"{name} {amount * count:g} needed, {free.get(name, 0.0):g} free of {total.get(name, 0.0):g}"
        for name, amount in sorted(bundle.items())
        if amount and free.get(name, 0.0) < amount * count
    ]
    if short:
        return "missing " + "; ".join(short)
    return "enough is free in all, but not on the nodes together as the bundles need"


@dataclass(frozen=True)
class NodePlacement:
    """Which node each worker must run on (None: wherever the cluster places it), and, for a
    source whose files are spread over nodes, the worker that reads each file."""

    worker_nodes: tuple[str | None, ...]
    file_readers: dict[str, int] | None = None

    @property
    def pinned(self) -> bool:
        return any(node is not None for node in self.worker_nodes)


def reading_node(holders: tuple[str, ...], capacity: dict[str, int], name: str, labels: dict[str, str]) -> str:
    """The node that reads the file `name`: the first of its `holders` with room for a worker."""
    roomy = [node for node in holders if capacity.get(node, 0) > 0]
    if not roomy:
        where = ", ".join(labels.get(node, node) for node in holders)
        raise ExportError(f"'{name}' is only on {where}, where no worker of this export fits")
    return roomy[0]


def place_by_files(
    files: dict[str, int], holders: dict[str, tuple[str, ...]], first_node: str, num_workers: int,
    capacity: dict[str, int], labels: dict[str, str], writers: int = 1,
) -> NodePlacement:
    """Place workers where the files are: the first file (rank 0's) on `first_node` by worker 0,
    every other file read once, on one of its holders (the least loaded), at least one worker
    on each node that reads any, `writers` on the first node where they fit, and the rest of
    `num_workers` given to the nodes with the most bytes per worker, within each node's
    `capacity` (workers it can hold). Within a node, files go byte-balanced to its workers."""
    first = next(iter(files))
    node_of = {first: first_node}
    load = {first_node: files[first]}
    for name in sorted(files, key=lambda name: (-files[name], name)):
        if name != first:
            candidates = [node for node in holders[name] if capacity.get(node, 0) > 0]
            if not candidates:
                reading_node(holders[name], capacity, name, labels)
            node = min(candidates, key=lambda node: (load.get(node, 0), labels.get(node, node)))
            node_of[name] = node
            load[node] = load.get(node, 0) + files[name]
    nodes = [first_node] + sorted((node for node in load if node != first_node), key=lambda node: labels.get(node, node))
    count = {node: 1 for node in nodes}
    count[first_node] = max(1, min(writers, capacity[first_node]))
    while sum(count.values()) < num_workers:
        roomy = [node for node in nodes if count[node] < capacity[node]]
        if not roomy:
            break
        busiest = max(roomy, key=lambda node: (load[node] / count[node], -nodes.index(node)))
        count[busiest] += 1
    worker_nodes = tuple(node for node in nodes for _ in range(count[node]))
    file_readers = {first: 0}
    for node in nodes:
        workers = [index for index, at in enumerate(worker_nodes) if at == node]
        loads = {worker: files[first] if worker == 0 else 0 for worker in workers}
        for name in sorted((name for name in files if node_of[name] == node and name != first), key=lambda name: (-files[name], name)):
            worker = min(workers, key=lambda worker: (loads[worker], worker))
            file_readers[name] = worker
            loads[worker] += files[name]
    return NodePlacement(worker_nodes, file_readers)


def pin_writers(node: str, num_workers: int, writers: int, capacity: dict[str, int]) -> NodePlacement:
    """Workers 0.. (the writers, at least one) on `node`, which holds a local destination; the
    rest wherever the cluster places them."""
    pinned = max(1, min(writers, num_workers, capacity.get(node, 0)))
    return NodePlacement((node,) * pinned + (None,) * (num_workers - pinned))


def worker_capacity(resources: dict[str, float], bundle: dict[str, float]) -> int:
    """How many workers of `bundle` a node with `resources` (its totals) can hold."""
    fits = [int(resources.get(name, 0.0) // amount) for name, amount in bundle.items() if amount]
    return min(fits) if fits else 0


def group_size(workers: int | None, cpus_per_worker: float, world_size: int, cpus: float) -> int:
    """How many workers an export starts: `--workers` (at most one per rank), else as many as
    the cluster's `cpus` hold, at most one per rank."""
    if workers is not None:
        return min(workers, world_size)
    return max(1, min(world_size, int(cpus // max(cpus_per_worker, 1e-9))))
