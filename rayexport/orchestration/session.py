"""Joining the Ray cluster an export runs on, or starting a local one set up for the export.

A Ray started here runs no dashboard, and the worker processes its raylet starts with it (one
per CPU) import what an export's actor runs (torch, the readers, the gather) while Ray's own
services come up, so that the actors start on processes that are ready. It is stopped without
the second that Ray's shutdown spends on its autoscaler monitor."""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import time
from typing import Callable, Iterator

from rayexport.orchestration.report import timed_stage

# What a worker process imports before it is handed an actor: `ExportWorker`'s module, and the
# readers' torch.distributed.checkpoint (with DTensor), which that module leaves to the load so
# that the driver, which imports it for the actor's class, does not pay for it.
WORKER_MODULE = "rayexport.orchestration.workers"
WORKER_PRELOADS = [WORKER_MODULE, "torch.distributed.checkpoint"]


def local_ray_settings(log_level: str) -> dict:
    """`ray.init`'s arguments for a local Ray. Its raylet starts a worker process per CPU as it
    comes up; each imports WORKER_PRELOADS before it is handed an actor."""
    return {
        "include_dashboard": False,
        "logging_level": log_level,
        "log_to_driver": True,
        "_system_config": {
            "preload_python_modules": WORKER_PRELOADS,
            # Ray keeps as many idle workers as there are free CPUs: once the export's placement
            # group holds them all, it would end the ready processes and start cold ones.
            "num_workers_soft_limit": os.cpu_count() or 1,
        },
    }


def starts_own_ray() -> bool:
    """Whether `ensure_ray` would start a local Ray: this process belongs to none and
    RAY_ADDRESS names no cluster to join."""
    import ray

    return not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")


# How `ensure_ray` made this process belong to Ray: what the process ends with.
STARTED, JOINED = "started", "joined"


def ensure_ray(log_level: str) -> str | None:
    """Join the Ray cluster at RAY_ADDRESS, or start a local one, unless this process already
    belongs to one. Returns STARTED (a Ray to stop), JOINED (a cluster to leave) or None (the
    process belonged to Ray already)."""
    import ray

    if starts_own_ray():
        ray.init(**local_ray_settings(log_level))
        return STARTED
    if not ray.is_initialized():
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=log_level, log_to_driver=True)
        return JOINED
    return None


@contextlib.contextmanager
def command_line_session(log_level: str, seconds: dict[str, float], whole_process: bool = False) -> Iterator[Callable[[], None]]:
    """The command line's Ray: started (or joined) at once, while `rayexport.orchestration.job` and what it
    imports load in a thread; on leaving, stopped when started here, left
    when joined here (a process that belonged to Ray already stays in it). Yields `imported()`,
    which waits for those imports: the caller may start the export's workers first
    (`rayexport.orchestration.start`). Into `seconds`:
    `imports` (the wait in `imported()`, and with `whole_process`, the program itself, this
    process's start to here), `ray_start`, and on leaving `ray_stop`."""
    import ray

    if whole_process:
        import psutil

        seconds["imports"] = round(time.time() - psutil.Process().create_time(), 3)
    importing = threading.Thread(target=importlib.import_module, args=("rayexport.orchestration.job",), daemon=True)
    importing.start()  # an import that fails raises again, with its own message, where it is used
    with timed_stage(seconds, "ray_start"):
        belongs = ensure_ray(log_level)

    def imported() -> None:
        with timed_stage(seconds, "imports"):
            importing.join()

    try:
        yield imported
    finally:
        if belongs == STARTED:
            with timed_stage(seconds, "ray_stop"):
                stop_started_ray()
        elif belongs == JOINED:
            ray.shutdown()  # leaving here spares Ray's exit handler its half-second wait for late log lines


def stop_started_ray() -> None:
    """Stop the Ray this process started. Its autoscaler monitor (of no use to a one-node Ray)
    is killed first, by its pid from this process's own Ray: `ray.shutdown` stops the GCS
    before it, the monitor's exit handler then waits on the stopped GCS, and Ray kills it only
    after a second's grace (1.0 of its 1.3 s here)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)  # this process's Ray, when it started one
    if node is not None:
        node.kill_monitor(check_alive=False)
    ray.shutdown()
