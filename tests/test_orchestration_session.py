"""The Ray a command line starts for itself: what its raylet's worker processes import before
they are handed an actor, and that it keeps them once a placement group holds every CPU. The
session's own Ray (conftest.py) starts with these settings, so every test runs on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import ray

from rayexport.orchestration.session import WORKER_MODULE, WORKER_PRELOADS, local_ray_settings


def test_the_worker_processes_import_the_module_of_the_export_actor():
    from rayexport.orchestration.workers import ExportWorker

    settings = local_ray_settings("INFO")
    assert ExportWorker.__module__ == WORKER_MODULE  # a worker moved elsewhere would start cold
    assert settings["_system_config"]["preload_python_modules"] == WORKER_PRELOADS
    assert WORKER_PRELOADS[0] == WORKER_MODULE
    assert settings["include_dashboard"] is False and settings["logging_level"] == "INFO"


def test_idle_processes_are_kept_while_the_export_holds_every_cpu():
    """Ray keeps as many idle workers as there are free CPUs; the export's placement group takes
    them all, and without the limit Ray would end the ready processes before the actors come."""
    assert local_ray_settings("INFO")["_system_config"]["num_workers_soft_limit"] >= (os.cpu_count() or 1)


def test_a_process_of_the_session_ray_has_imported_the_worker_module_before_it_runs_anything(ray_address):
    # defined in a module of its own name ("__main__"), the function travels by value: running
    # it in a worker imports nothing of this test's modules
    namespace = {"__name__": "__main__"}
    exec("def imported(name):\n    import sys\n    return name in sys.modules", namespace)
    for module in WORKER_PRELOADS:
        assert ray.get(ray.remote(num_cpus=0)(namespace["imported"]).remote(module))
    assert not ray.get(ray.remote(num_cpus=0)(namespace["imported"]).remote("rayexport.no_such_module"))


def test_the_imports_phase_counts_the_process_only_where_it_is_the_command(ray_address):
    """`python -m rayexport.run` counts its own start and imports; `main()` called in a running
    process (as here) does not report that process's age as the export's imports."""
    import time

    import psutil

    from rayexport.orchestration.session import command_line_session

    age = time.time() - psutil.Process().create_time()
    called, command = {}, {}
    with command_line_session("WARNING", called) as imported:
        imported()
    with command_line_session("WARNING", command, whole_process=True) as imported:
        imported()
    assert command["imports"] + 0.001 >= age > called["imports"]  # the seconds are rounded to the millisecond
    assert "ray_stop" not in called and "ray_stop" not in command  # joined, not started: left running


# A process that starts a local Ray as the command line does, stops it, and prints which of
# the processes it had started (every descendant: services, monitor, workers) still run.
STARTS_AND_STOPS = """
import json, time, psutil, ray
from rayexport.orchestration.session import local_ray_settings, stop_started_ray
ray.init(**local_ray_settings("ERROR"))
ray.get(ray.remote(lambda: 1).remote())
started = psutil.Process().children(recursive=True)
names = sorted({" ".join(process.cmdline())[:200] for process in started})
stop_started_ray()
time.sleep(1.0)
alive = [process.pid for process in started if process.is_running() and process.status() != psutil.STATUS_ZOMBIE]
print(json.dumps({"names": names, "alive": alive}))
"""


@pytest.mark.slow
def test_a_ray_the_command_started_is_stopped_with_all_its_processes():
    """The command's own Ray is stopped with its monitor killed first (Ray's shutdown would wait
    a second for it): nothing it started outlives the stop."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    completed = subprocess.run([sys.executable, "-c", STARTS_AND_STOPS], capture_output=True, text=True, timeout=180, env=env)
    assert completed.returncode == 0, completed.stderr[-2000:]
    found = json.loads(completed.stdout.strip().splitlines()[-1])
    assert any("monitor.py" in name for name in found["names"]) and any("raylet" in name for name in found["names"])
    assert found["alive"] == []
