"""`export_remote()`: start an export from inside a running Ray program and return at once.

For RL frameworks that save a checkpoint every N steps: the export runs as a Ray task that
drives its own worker actors (on CPUs unless the caller asks for GPUs), so training goes on. The
caller's Ray session is used as it is, never initialised or shut down here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rayexport.common.errors import ExportError, one_line
from rayexport.orchestration.options import ExportOptions


class ExportFailed(ExportError):
    """An export started with `export_remote` failed; the message is the CLI's one line."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = one_line(message)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # `ray.get` raises the task's ExportFailed as an instance of a class Ray derives from it
        # and RayTaskError, whose text is the task's traceback over many lines: keep the one line.
        super().__init_subclass__(**kwargs)
        cls.__str__ = ExportFailed.__str__

    def __str__(self) -> str:
        return self.message


def export_remote(src: str, dst: str, *, max_concurrent: int | None = None, **options: Any):
    """Start exporting `src` to `dst` and return a Ray ObjectRef to its `ExportReport`.

    `options` are `ExportOptions` fields (`workers`, `num_cpus_per_worker`, `backend`, ...).
    Unlike the CLI, the export stays off the GPUs (gloo, `num_gpus_per_worker=0`) unless the
    caller asks for them with `num_gpus_per_worker` or `backend="nccl"` (then one GPU per worker
    by default): inside a training job the GPUs are the trainer's. Several calls may be in
    flight; with `max_concurrent`, at most that many run at once and the rest wait.
    `ray.get(ref)` raises `ExportFailed` (an `ExportError`) with the CLI's message on failure.
    """
    import ray

    if not ray.is_initialized():
        raise ExportError("export_remote() needs a running Ray session: call ray.init() first")
    if options.get("backend", "auto") != "nccl":
        options.setdefault("num_gpus_per_worker", 0)
    export_options = ExportOptions(src=src, dst=dst, **options)  # bad options fail here, not later
    limiter = _limiter(max_concurrent) if max_concurrent else None
    task = ray.remote(num_cpus=0, max_retries=0)(_run_remote_export)
    return task.remote(export_options, limiter)


def _run_remote_export(options: ExportOptions, limiter):
    import ray

    from rayexport.orchestration.job import run_export

    if limiter is not None:
        ray.get(limiter.acquire.remote())
    try:
        return run_export(options)
    except ExportError as error:
        raise ExportFailed(str(error)) from None
    finally:
        if limiter is not None:
            ray.get(limiter.release.remote())


def _limiter(max_concurrent: int):
    """One named actor per limit, shared by every caller in the cluster."""
    import ray

    return ray.remote(ConcurrencyLimit).options(
        name=f"rayexport-concurrency-{max_concurrent}", namespace="rayexport", get_if_exists=True,
        lifetime="detached", num_cpus=0,
    ).remote(max_concurrent)


class ConcurrencyLimit:
    """A cluster-wide semaphore (an async Ray actor): exports beyond the limit wait in
    `acquire`, in arrival order."""

    def __init__(self, limit: int) -> None:
        self.semaphore = asyncio.Semaphore(limit)

    async def acquire(self) -> None:
        await self.semaphore.acquire()

    async def release(self) -> None:
        self.semaphore.release()
