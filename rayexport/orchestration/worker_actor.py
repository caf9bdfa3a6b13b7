"""The Ray actor an export's worker runs in, started by a driver that has not imported what the
worker runs: `ExportWorker`'s module (torch, the readers, the gather) is imported in the actor's
own process, and the driver need not import torch at all (`rayexport.orchestration.start`).

`ExportWorkerActor` has each public method of `ExportWorker`, named as there (Ray's task names
and process titles say which one runs), each calling the worker it holds."""

from __future__ import annotations

from typing import Any, Callable

# ExportWorker's public methods, each the actor's too (tests/test_orchestration_worker_actor.py
# checks that the two lists agree).
WORKER_METHODS = (
    "prepare_checks", "consumer_checks", "open_rendezvous", "join_group", "load", "tied_differences", "scan_ahead",
    "read_pieces", "transfer", "check_files", "progress", "stats", "release_pages", "reset", "close",
)


def _host(self, *arguments: Any) -> None:
    """Start the worker (`ExportWorker(*arguments)`), importing its module in this process."""
    from rayexport.orchestration.workers import ExportWorker

    self.worker = ExportWorker(*arguments)


def _forwarding(name: str) -> Callable:
    def method(self, *arguments: Any, **keywords: Any) -> Any:
        return getattr(self.worker, name)(*arguments, **keywords)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"`ExportWorker.{name}` of the worker this actor holds."
    return method


# Built from the list rather than written out: a method each, of one line each, named as the worker's.
ExportWorkerActor = type(
    "ExportWorkerActor", (), {
        "__module__": __name__,
        "__doc__": "An export's worker as a Ray actor: `ExportWorker(*arguments)` in the actor's process.",
        "__init__": _host,
        **{name: _forwarding(name) for name in WORKER_METHODS},
    },
)
