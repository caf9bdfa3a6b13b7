"""The run's choices (no cluster needed) and the whole job's deadline. The worker group's step
limits are in test_group.py, the choice of backend and GPUs in test_orchestration_placement.py."""

import time

import pytest

from rayexport.common.errors import ExportError
from rayexport.orchestration.job import export


def test_an_export_past_its_deadline_stops_and_commits_nothing(checkpoints, ray_address, tmp_path):
    started = time.monotonic()
    with pytest.raises(ExportError, match="timed out.*--deadline 1 s for the whole export"):
        export(checkpoints["tied"].path, str(tmp_path / "out"), deadline_s=1, verify="none")
    assert time.monotonic() - started < 30
    assert not (tmp_path / "out" / "export_manifest.json").exists()


def test_a_tied_pair_no_worker_compared_stops_the_export():
    """Workers report only the pairs they held both copies of; a pair none of them could compare
    used to count as equal and its alias was dropped unchecked."""
    from rayexport.orchestration.job import _plan_ties
    from support.plan_cases import EMBED, HEAD, TIED, expected_of, fsdp2_ranks, plan_tensors

    class WorkersThatHeldTheCopiesApart:  # stands for a WorkerGroup whose workers each held one copy
        def tied_differences(self, pairs):
            return {}

    ranks = fsdp2_ranks({EMBED: (10, 4), HEAD: (10, 4)}, 2)
    plan = lambda untied: plan_tensors(ranks, expected_of({EMBED: (10, 4), HEAD: (10, 4)}), TIED)  # noqa: E731
    with pytest.raises(ExportError, match=f"tied tensors '{EMBED}' and '{HEAD}' were read by different workers"):
        _plan_ties(plan, WorkersThatHeldTheCopiesApart(), untie=False)
