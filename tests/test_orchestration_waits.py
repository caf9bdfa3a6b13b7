"""rayexport.orchestration.waits: how long each distributed step may take. The group's behaviour with a real
cluster (placement, fail-fast waits, pools) is covered where it shows: test_gpu_cluster.py,
test_orchestration_workers.py, test_orchestration_pool.py, test_faults.py."""

import time

import pytest

from rayexport.common.errors import ExportError
from rayexport.orchestration.options import ExportOptions
from rayexport.orchestration.waits import cancel_unfinished, get_all, step_limit


def test_a_step_gets_the_timeout_unless_the_job_deadline_is_nearer():
    options = ExportOptions(src="a", dst="b", timeout_s=60, deadline_s=600)
    assert step_limit(options, time.monotonic() + 600) == (60, "--timeout")
    seconds, source = step_limit(options, time.monotonic() + 5)
    assert 4 < seconds <= 5 and source.startswith("--deadline 600 s")
    with pytest.raises(ExportError, match="past its --deadline 600 s"):
        step_limit(options, time.monotonic() - 1)


def test_a_failed_step_cancels_only_the_tasks_still_running(ray_address):
    """A task that already failed is left alone (Ray's driver can abort when a force-cancel
    crosses such a task's reply); one still running is cancelled."""
    import ray
    from ray.exceptions import TaskCancelledError

    def _fails() -> None:  # defined here, so that Ray pickles it by value
        raise ExportError("the check failed")

    def _sleeps() -> None:
        time.sleep(600)

    failed = ray.remote(num_cpus=0, max_retries=0)(_fails).remote()
    running = ray.remote(num_cpus=0, max_retries=0)(_sleeps).remote()
    ray.wait([failed], timeout=60)
    with pytest.raises(ExportError, match="the check failed"):
        get_all([failed], (60, "--timeout"), on_failure=lambda: cancel_unfinished([failed, running]))
    with pytest.raises(TaskCancelledError):
        ray.get(running, timeout=60)
    with pytest.raises(ray.exceptions.RayTaskError, match="the check failed"):  # its own error, not a cancellation
        ray.get(failed, timeout=0)
