"""rayexport.group: how long each distributed step may take, and the reload actor's end. The
group's behaviour with a real cluster (placement, fail-fast waits, pools) is covered where it
shows: test_gpu_cluster.py, test_workers.py, test_pool.py, test_faults.py."""

import os
import time

import psutil
import pytest

from helpers import actor_processes
from rayexport.errors import ExportError
from rayexport.group import WorkerGroup, step_limit
from rayexport.options import ExportOptions


def test_a_step_gets_the_timeout_unless_the_job_deadline_is_nearer():
    options = ExportOptions(src="a", dst="b", timeout_s=60, deadline_s=600)
    assert step_limit(options, time.monotonic() + 600) == (60, "--timeout")
    seconds, source = step_limit(options, time.monotonic() + 5)
    assert 4 < seconds <= 5 and source.startswith("--deadline 600 s")
    with pytest.raises(ExportError, match="past its --deadline 600 s"):
        step_limit(options, time.monotonic() - 1)


def _started_reload(before: set[int]) -> tuple[psutil.Process, psutil.Process]:
    """The new reload actor's process (not in `before`) and the reload process it started."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for actor in actor_processes("ReloadProcess"):
            children = [child for child in actor.children() if "rayexport.reload_check" in " ".join(child.cmdline())]
            if actor.pid not in before and children:
                return actor, children[0]
        time.sleep(0.2)
    raise AssertionError("no reload actor started its reload process within 60 s")


def _ended(process: psutil.Process, within_s: float = 30) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def test_a_reload_actor_never_outlives_its_export(ray_address):
    """The reload process starts before the export is written. An export that fails first ends
    its actor (the reload process and its scratch folder go with it); an actor killed outright
    takes its reload process along too."""
    import ray

    group = WorkerGroup(1, None, ExportOptions(src="a", dst="b"), time.monotonic() + 600)
    before = {process.pid for process in actor_processes("ReloadProcess")}
    group.start_reloader()
    actor, child = _started_reload(before)
    scratch = os.path.dirname(child.cwd())
    group.shutdown(graceful=False)
    assert _ended(child) and _ended(actor) and not os.path.exists(scratch)

    group.start_reloader()
    killed = group.reloader
    actor, child = _started_reload(before | {actor.pid})
    ray.kill(killed)
    assert _ended(actor) and _ended(child)
