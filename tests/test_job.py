"""Orchestration choices (most need no cluster) and the whole job's deadline. The choice of
backend and GPUs is in test_placement.py."""

import time

import pytest

from rayexport.errors import ExportError
from rayexport.group import step_limit
from rayexport.job import export, verify_level
from rayexport.options import FULL_VERIFY_LIMIT, ExportOptions


def test_auto_verification_is_full_for_models_that_fit():
    assert verify_level("auto", FULL_VERIFY_LIMIT) == "full"
    assert verify_level("auto", FULL_VERIFY_LIMIT + 1) == "quick"
    assert verify_level("none", 10) == "none"


def test_a_step_gets_the_timeout_unless_the_job_deadline_is_nearer():
    options = ExportOptions(src="a", dst="b", timeout_s=60, deadline_s=600)
    assert step_limit(options, time.monotonic() + 600) == (60, "--timeout")
    seconds, source = step_limit(options, time.monotonic() + 5)
    assert 4 < seconds <= 5 and source.startswith("--deadline 600 s")
    with pytest.raises(ExportError, match="past its --deadline 600 s"):
        step_limit(options, time.monotonic() - 1)


def test_an_export_past_its_deadline_stops_and_commits_nothing(checkpoints, ray_address, tmp_path):
    started = time.monotonic()
    with pytest.raises(ExportError, match="timed out.*--deadline 1 s for the whole export"):
        export(checkpoints["tied"].path, str(tmp_path / "out"), deadline_s=1, verify="none")
    assert time.monotonic() - started < 30
    assert not (tmp_path / "out" / "export_manifest.json").exists()
