"""rayexport.waits: how long each distributed step may take. The group's behaviour with a real
cluster (placement, fail-fast waits, pools) is covered where it shows: test_gpu_cluster.py,
test_workers.py, test_pool.py, test_faults.py."""

import time

import pytest

from rayexport.errors import ExportError
from rayexport.waits import step_limit
from rayexport.options import ExportOptions


def test_a_step_gets_the_timeout_unless_the_job_deadline_is_nearer():
    options = ExportOptions(src="a", dst="b", timeout_s=60, deadline_s=600)
    assert step_limit(options, time.monotonic() + 600) == (60, "--timeout")
    seconds, source = step_limit(options, time.monotonic() + 5)
    assert 4 < seconds <= 5 and source.startswith("--deadline 600 s")
    with pytest.raises(ExportError, match="past its --deadline 600 s"):
        step_limit(options, time.monotonic() - 1)
