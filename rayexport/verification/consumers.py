"""Consumer checks: the libraries users load an export with, each loading it as they will.

`CONSUMER_CHECKS` is the list every verification runs (`run_consumer_checks`; during an export,
on the exporter, worker 0, with what `prepare_consumer_checks` started when the worker did);
each check's result goes under its `name` in the verification's checks. Adding a consumer (a
vLLM load, say) is one module with a `ConsumerCheck` subclass and one entry in the list.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

from rayexport.storage import Store
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.reload.parent import ReloadProcess, check_reload


class ConsumerCheck(ABC):
    """One consumer of the export, checked loading it; a failure raises VerificationError
    naming what the consumer could not load."""

    name: str  # the key of its result in the verification's checks

    @abstractmethod
    def runs_at(self, level: str) -> bool:
        """Whether the check runs when the export is verified at `level`."""

    def prepare(self) -> Any:
        """Start what the check can start before the export is written (its process, so that
        its imports overlap the export); `run` is handed it. None: nothing to start."""
        return None

    def discard(self, prepared: Any) -> None:
        """End what `prepare` started, for a check that will not run."""

    @abstractmethod
    def run(
        self, destination: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int, prepared: Any = None,
    ) -> dict[str, Any]:
        """Check the export at `destination` within `timeout_s` seconds, holding at most
        `memory_bound_bytes` above the checking process's start-up, with what `prepare`
        started (None: start it now); its numbers."""

    def warning(self, result: dict[str, Any]) -> str | None:
        """A line for the export's log about how the check ran (None: nothing to say)."""
        return None


class TransformersReload(ConsumerCheck):
    """transformers loads the export in a process of its own (peft the adapter, AutoTokenizer
    the tokenizer): `reload.parent.check_reload`."""

    name = "reload"

    def runs_at(self, level: str) -> bool:
        """At every level the export is verified at (at `quick`, it compares keys only)."""
        return True

    def prepare(self) -> ReloadProcess:
        """The reload's process, importing torch and transformers while the export is written."""
        return ReloadProcess()

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


CONSUMER_CHECKS: list[ConsumerCheck] = [TransformersReload()]


def prepare_consumer_checks(checks: Sequence[ConsumerCheck] = CONSUMER_CHECKS) -> dict[str, Any]:
    """What each of `checks` starts ahead of the export (see `ConsumerCheck.prepare`), by name."""
    return {check.name: prepared for check in checks if (prepared := check.prepare()) is not None}


def discard_prepared(prepared: dict[str, Any], checks: Sequence[ConsumerCheck] = CONSUMER_CHECKS) -> None:
    """End what `prepare_consumer_checks` started and no check used."""
    for check in checks:
        if check.name in prepared:
            check.discard(prepared.pop(check.name))


def run_consumer_checks(
    destination: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int,
    checks: Sequence[ConsumerCheck] = CONSUMER_CHECKS, prepared: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Each of `checks` that runs at the export's level, in order, with what it `prepared`
    (started now where nothing was): its result by its name. What no check used is ended."""
    prepared = dict(prepared or {})
    try:
        return {
            check.name: check.run(destination, expected, timeout_s, memory_bound_bytes, prepared.pop(check.name, None))
            for check in checks if check.runs_at(expected.level)
        }
    finally:
        discard_prepared(prepared, checks)


def consumer_warnings(results: dict[str, dict[str, Any]], checks: Sequence[ConsumerCheck] = CONSUMER_CHECKS) -> list[str]:
    """The log lines the consumer checks' `results` call for."""
    return [warning for check in checks if check.name in results and (warning := check.warning(results[check.name]))]
