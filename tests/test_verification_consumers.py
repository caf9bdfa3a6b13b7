"""Consumer checks as a list: each one's result under its name in the verification's outcome,
only at the levels it runs at."""

from __future__ import annotations

from rayexport.common.levels import FULL, NONE, QUICK
from rayexport.storage.store import Store
from rayexport.verification.consumers import (
    CONSUMER_CHECKS, ConsumerCheck, TransformersReload, consumer_warnings, prepare_consumer_checks, run_consumer_checks,
)
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.outcome import verification_outcome
from rayexport.verification.serving import ServeRequest
from rayexport.verification.serving.vllm_check import VllmServe

FILE_CHECKS = {"files": {"files": 3, "bytes_read": 10}}


class Recorded(ConsumerCheck):
    """A consumer that runs at `levels` and reports what it was given."""

    def __init__(self, name: str, levels: set[str]) -> None:
        self.name, self.levels = name, levels

    def runs_for(self, expected) -> bool:
        return expected.level in self.levels

    def run(self, destination, expected, timeout_s, memory_bound_bytes, prepared=None):
        return {"consumer": self.name, "level": expected.level, "timeout_s": timeout_s, "bound": memory_bound_bytes}


class Prepared(Recorded):
    """A consumer that starts something ahead (`prepare`): what its run was handed, and which
    of its prepared things were ended unused."""

    def __init__(self, name: str, levels: set[str]) -> None:
        super().__init__(name, levels)
        self.discarded: list[str] = []

    def prepare(self, cpus=1):
        return f"{self.name}'s process"

    def discard(self, prepared) -> None:
        self.discarded.append(prepared)

    def run(self, destination, expected, timeout_s, memory_bound_bytes, prepared=None):
        return {"prepared": prepared}


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


def test_a_check_runs_with_what_it_prepared_and_what_no_check_ran_with_is_ended(tmp_path):
    checks = [Prepared("reload", {FULL, QUICK}), Prepared("vllm", {FULL})]
    prepared = prepare_consumer_checks(checks)
    assert prepared == {"reload": "reload's process", "vllm": "vllm's process"}
    expected = ExpectedExport(files={}, tensors={}, level=QUICK)
    results = run_consumer_checks(Store(str(tmp_path)), expected, 60, 1024, checks, prepared)
    assert results == {"reload": {"prepared": "reload's process"}}  # vllm does not run at quick...
    assert checks[1].discarded == ["vllm's process"] and checks[0].discarded == []  # ...and its process is ended
    assert run_consumer_checks(Store(str(tmp_path)), expected, 60, 1024, checks) == {"reload": {"prepared": None}}


def test_without_file_checks_the_outcome_says_nothing_was_checked():
    assert verification_outcome(NONE, None, {}) == {"passed": None, "level": "none"}


def test_the_list_is_the_transformers_reload_then_the_vllm_check_only_when_asked_for():
    assert [type(check) for check in CONSUMER_CHECKS] == [TransformersReload, VllmServe]
    reload, vllm = CONSUMER_CHECKS
    for level in (FULL, QUICK):
        plain = ExpectedExport(files={}, tensors={}, level=level)
        asked = ExpectedExport(files={}, tensors={}, level=level, serve=ServeRequest("vllm", None, 2.0))
        assert reload.runs_for(plain) and reload.runs_for(asked)
        assert not vllm.runs_for(plain) and vllm.runs_for(asked)
    assert (reload.name, vllm.name, reload.gpus(asked), vllm.gpus(asked)) == ("reload", "vllm", 0.0, 2.0)


class WantsGpus(Recorded):
    def gpus(self, expected) -> float:
        return 1.0


def test_a_check_that_asks_for_gpus_goes_through_the_runner_and_runs_here_without_one(tmp_path):
    checks = [Recorded("reload", {FULL}), WantsGpus("vllm", {FULL})]
    expected = ExpectedExport(files={}, tensors={}, level=FULL)
    given = []

    def runner(check, gpus, *arguments):
        given.append((check.name, gpus))
        return {"on": "a GPU"}

    results = run_consumer_checks(Store(str(tmp_path)), expected, 60, 1024, checks, gpu_runner=runner)
    assert given == [("vllm", 1.0)] and results["vllm"] == {"on": "a GPU"} and results["reload"]["consumer"] == "reload"
    assert run_consumer_checks(Store(str(tmp_path)), expected, 60, 1024, checks)["vllm"]["consumer"] == "vllm"


def test_the_reload_asks_for_a_warning_only_when_the_streamed_reload_declined():
    declined = {"mode": "keys-only", "reason": "module 'model.embed_tokens' alone holds 9 bytes"}
    assert consumer_warnings({"reload": declined}) == [declined["reason"]]
    assert consumer_warnings({"reload": {"mode": "streamed"}}) == [] == consumer_warnings({})
