"""Consumer checks as a list: each one's result under its name in the verification's outcome,
only at the levels it runs at."""

from __future__ import annotations

from rayexport.levels import FULL, NONE, QUICK
from rayexport.storage import Store
from rayexport.verification.consumers import (
    CONSUMER_CHECKS, ConsumerCheck, TransformersReload, consumer_warnings, run_consumer_checks,
)
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.outcome import verification_outcome

FILE_CHECKS = {"files": {"files": 3, "bytes_read": 10}}


class Recorded(ConsumerCheck):
    """A consumer that runs at `levels` and reports what it was given."""

    def __init__(self, name: str, levels: set[str]) -> None:
        self.name, self.levels = name, levels

    def runs_at(self, level: str) -> bool:
        return level in self.levels

    def run(self, destination, expected, timeout_s, memory_bound_bytes):
        return {"consumer": self.name, "level": expected.level, "timeout_s": timeout_s, "bound": memory_bound_bytes}


def test_each_consumer_result_is_under_its_name_and_one_that_does_not_run_is_absent(tmp_path):
    checks = [Recorded("reload", {FULL, QUICK}), Recorded("vllm", {FULL})]
    for level, names in ((FULL, ["reload", "vllm"]), (QUICK, ["reload"])):
        expected = ExpectedExport(files={}, tensors={}, level=level)
        results = run_consumer_checks(Store(str(tmp_path)), expected, 60, 1024, checks)
        outcome = verification_outcome(level, FILE_CHECKS, results)
        assert outcome == {
            "passed": True, "level": level,
            "checks": {**FILE_CHECKS, **{name: {"consumer": name, "level": level, "timeout_s": 60, "bound": 1024} for name in names}},
        }


def test_without_file_checks_the_outcome_says_nothing_was_checked():
    assert verification_outcome(NONE, None, {}) == {"passed": None, "level": "none"}


def test_the_list_is_the_transformers_reload_under_reload():
    assert [type(check) for check in CONSUMER_CHECKS] == [TransformersReload]
    assert CONSUMER_CHECKS[0].name == "reload" and all(CONSUMER_CHECKS[0].runs_at(level) for level in (FULL, QUICK))


def test_the_reload_asks_for_a_warning_only_when_the_streamed_reload_declined():
    declined = {"mode": "keys-only", "reason": "module 'model.embed_tokens' alone holds 9 bytes"}
    assert consumer_warnings({"reload": declined}) == [declined["reason"]]
    assert consumer_warnings({"reload": {"mode": "streamed"}}) == [] == consumer_warnings({})
