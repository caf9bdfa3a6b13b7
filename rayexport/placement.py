"""Where the export's workers run: gloo on CPUs, or NCCL with a whole GPU per worker, decided
from what the Ray cluster can place when the export starts; and, when a placement cannot be
made, one line saying which resources are missing. Pure functions: the job passes in the
cluster's resources."""

from __future__ import annotations

from dataclasses import dataclass

from rayexport.errors import ExportError


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
