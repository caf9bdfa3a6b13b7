"""The run's choices (no cluster needed) and the whole job's deadline. The worker group's step
limits are in test_group.py, the choice of backend and GPUs in test_placement.py."""

import time

import pytest

from rayexport.errors import ExportError
from rayexport.job import export, verify_level
from rayexport.options import FULL_VERIFY_LIMIT


def test_auto_verification_is_full_for_models_that_fit():
    assert verify_level("auto", FULL_VERIFY_LIMIT) == "full"
    assert verify_level("auto", FULL_VERIFY_LIMIT + 1) == "quick"
    assert verify_level("none", 10) == "none"


def test_an_export_past_its_deadline_stops_and_commits_nothing(checkpoints, ray_address, tmp_path):
    started = time.monotonic()
    with pytest.raises(ExportError, match="timed out.*--deadline 1 s for the whole export"):
        export(checkpoints["tied"].path, str(tmp_path / "out"), deadline_s=1, verify="none")
    assert time.monotonic() - started < 30
    assert not (tmp_path / "out" / "export_manifest.json").exists()
