"""Consumer checks: the libraries users load an export with, each loading it as they will.

`CONSUMER_CHECKS` is the list every verification runs (`run_consumer_checks`; during an export,
on the exporter, worker 0, with what `prepare_consumer_checks` started when the worker did);
each check's result goes under its `name` in the verification's checks: the transformers
reload, then the serve check a user asked for (`serving`). Adding a consumer is one module with
a `ConsumerCheck` subclass (`consumer_check`) and one entry in the list.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from rayexport.storage.store import Store
from rayexport.verification.consumer_check import ConsumerCheck
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.reload.parent import ReloadProcess, check_reload
from rayexport.verification.serving.vllm_check import VllmServe

# Runs a check that asks for GPUs (`ConsumerCheck.gpus`) where the cluster has them: given by
# the orchestration (rayexport.orchestration.workers), called with the check, its GPUs and `run`'s arguments.
GpuRunner = Callable[..., dict[str, Any]]


class TransformersReload(ConsumerCheck):
    """transformers loads the export in a process of its own (peft the adapter, AutoTokenizer
    the tokenizer): `reload.parent.check_reload`."""

    name = "reload"

    def runs_for(self, expected: ExpectedExport) -> bool:
        """At every level the export is verified at (at `quick`, it compares keys only)."""
        return True

    def prepare(self, cpus: int = 1) -> ReloadProcess:
        """The reload's process, importing torch and transformers while the export is written;
        its forward pass runs `cpus` threads."""
        return ReloadProcess(threads=cpus)

    def discard(self, prepared: ReloadProcess) -> None:
        prepared.close()

    def run(
        self, destination: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int,
        prepared: ReloadProcess | None = None,
    ) -> dict[str, Any]:
        """The reload's result, its memory (`startup_rss_bytes`, `peak_rss_bytes`) and its
        process's start (`started_at`, `imports_s`, `waited_s`) included."""
        return check_reload(destination, expected, timeout_s, memory_bound_bytes, prepared)

    def warning(self, result: dict[str, Any]) -> str | None:
        """Why the streamed reload declined to the keys check, when it did."""
        return result.get("reason")


CONSUMER_CHECKS: list[ConsumerCheck] = [TransformersReload(), VllmServe()]


def prepare_consumer_checks(checks: Sequence[ConsumerCheck] = CONSUMER_CHECKS, cpus: int = 1) -> dict[str, Any]:
    """What each of `checks` starts ahead of the export (see `ConsumerCheck.prepare`), by name,
    each to use `cpus` CPUs once it runs."""
    return {check.name: prepared for check in checks if (prepared := check.prepare(cpus)) is not None}


def discard_prepared(prepared: dict[str, Any], checks: Sequence[ConsumerCheck] = CONSUMER_CHECKS) -> None:
    """End what `prepare_consumer_checks` started and no check used."""
    for check in checks:
        if check.name in prepared:
            check.discard(prepared.pop(check.name))


def run_consumer_checks(
    destination: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int,
    checks: Sequence[ConsumerCheck] = CONSUMER_CHECKS, prepared: dict[str, Any] | None = None,
    gpu_runner: GpuRunner | None = None,
) -> dict[str, dict[str, Any]]:
    """Each of `checks` that runs for the export, in order, with what it `prepared` (started
    now where nothing was): its result by its name. A check that asks for GPUs goes through
    `gpu_runner` when there is one (else it runs here). What no check used is ended."""
    prepared = dict(prepared or {})
    results = {}
    try:
        for check in checks:
            if not check.runs_for(expected):
                continue
            arguments = (destination, expected, timeout_s, memory_bound_bytes, prepared.pop(check.name, None))
            gpus = check.gpus(expected)
            results[check.name] = gpu_runner(check, gpus, *arguments) if gpus and gpu_runner else check.run(*arguments)
        return results
    finally:
        discard_prepared(prepared, checks)


def consumer_warnings(results: dict[str, dict[str, Any]], checks: Sequence[ConsumerCheck] = CONSUMER_CHECKS) -> list[str]:
    """The log lines the consumer checks' `results` call for."""
    return [warning for check in checks if check.name in results and (warning := check.warning(results[check.name]))]
