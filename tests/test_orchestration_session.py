"""The Ray a command line starts for itself: what its raylet's worker processes import before
they are handed an actor, and that it keeps them once a placement group holds every CPU. The
session's own Ray (conftest.py) starts with these settings, so every test runs on them."""

from __future__ import annotations

import os

import ray

from rayexport.orchestration.session import WORKER_MODULE, local_ray_settings


def test_the_worker_processes_import_the_module_of_the_export_actor():
    from rayexport.orchestration.workers import ExportWorker

    settings = local_ray_settings("INFO")
    assert ExportWorker.__module__ == WORKER_MODULE  # a worker moved elsewhere would start cold
    assert settings["_system_config"]["preload_python_modules"] == [WORKER_MODULE]
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
    assert ray.get(ray.remote(num_cpus=0)(namespace["imported"]).remote(WORKER_MODULE))
    assert not ray.get(ray.remote(num_cpus=0)(namespace["imported"]).remote("rayexport.no_such_module"))


def test_the_imports_phase_counts_the_process_only_where_it_is_the_command(ray_address):
    """`python -m rayexport.run` counts its own start and imports; `main()` called in a running
    process (as here) does not report that process's age as the export's imports."""
    import time

    import psutil

    from rayexport.orchestration.session import command_line_session

    age = time.time() - psutil.Process().create_time()
    called, command = {}, {}
    with command_line_session("WARNING", called):
        pass
    with command_line_session("WARNING", command, whole_process=True):
        pass
    assert command["imports"] + 0.001 >= age > called["imports"]  # the seconds are rounded to the millisecond
    assert "ray_stop" not in called and "ray_stop" not in command  # joined, not started: left running
