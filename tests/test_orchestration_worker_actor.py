"""rayexport.orchestration.worker_actor: the actor answers each of ExportWorker's public methods
under its own name, by calling the worker it holds."""

from __future__ import annotations

import inspect

from rayexport.orchestration.worker_actor import WORKER_METHODS, ExportWorkerActor


def test_the_actor_answers_every_public_method_of_the_worker_under_its_name():
    from rayexport.orchestration.workers import ExportWorker

    public = {name for name, member in inspect.getmembers(ExportWorker, inspect.isfunction) if not name.startswith("_")}
    assert set(WORKER_METHODS) == public
    for name in WORKER_METHODS:
        assert getattr(ExportWorkerActor, name).__name__ == name


def test_the_actor_calls_the_worker_it_holds():
    class Recorder:
        def __init__(self, *arguments):
            self.arguments = arguments

        def load(self, *arguments, **keywords):
            return self.arguments, arguments, keywords

    actor = ExportWorkerActor.__new__(ExportWorkerActor)
    actor.worker = Recorder(0, 2)
    assert actor.load("checkpoint", part="part") == ((0, 2), ("checkpoint",), {"part": "part"})
