"""rayexport.orchestration.start and worker_actor: a driver plans its export and starts its workers
without importing torch (which its workers import in their own processes), and the actor
answers each of ExportWorker's methods under its own name."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

from rayexport.orchestration.worker_actor import WORKER_METHODS, ExportWorkerActor

# A driver that refuses torch while it joins the session's Ray and begins an export of a verl
# checkpoint (the plan, the placement group, the actors and their process group), which the
# model's description, in the planning thread, needs (the command line imports it in a thread of
# its own meanwhile): that thread fails. Then, torch allowed (the workers' answers are objects of
# their module), it asks the workers to load, and prints what it saw.
STARTS_WITHOUT_TORCH = """
import json, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"the driver imported {name} before its workers started")

sys.meta_path.insert(0, NoTorch())
import ray
from rayexport.orchestration.options import ExportOptions
from rayexport.orchestration.start import begin_export
ray.init(logging_level="ERROR")
started = begin_export(ExportOptions(src=sys.argv[1], dst=sys.argv[2], verify="none", workers=2))
driver_torch = "torch" in sys.modules
describing = repr(started.describing.exception())
sys.meta_path.pop(0)
try:
    pids = ray.get([actor.stats.remote() for actor in started.group.actors])
    loaded = started.group.load(started.plan.checkpoint, {})
    print(json.dumps({"workers": [stats.pid for stats in pids], "ranks": sorted(loaded.rank_infos),
                      "driver_torch": driver_torch, "describing": describing}))
finally:
    started.group.shutdown(graceful=False)
"""


def test_the_driver_starts_its_workers_and_they_load_without_it_importing_torch(checkpoints, ray_address, tmp_path):
    """What lets a command line joined to a running cluster start its workers while it imports
    torch itself: nothing on the way to them (planning, placement, the actors, their process
    group) imports it in the driver."""
    ran = subprocess.run(
        [sys.executable, "-c", STARTS_WITHOUT_TORCH, checkpoints["tied"].path, str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    assert len(set(seen["workers"])) == 2 and seen["ranks"] == [0, 1, 2] and seen["driver_torch"] is False
    assert "the driver imported torch" in seen["describing"]  # the description alone wanted it


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
