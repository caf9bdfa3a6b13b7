"""Consumer checks: the libraries users load an export with, each loading it as they will.

`CONSUMER_CHECKS` is the list every verification runs (`run_consumer_checks`, in a Ray task of
its own during an export); each check's result goes under its `name` in the verification's
checks. Adding a consumer (a vLLM load, say) is one module with a `ConsumerCheck` subclass and
one entry in the list.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

from rayexport.storage import Store
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.reload.parent import check_reload


class ConsumerCheck(ABC):
    """One consumer of the export, checked loading it; a failure raises VerificationError
    naming what the consumer could not load."""

    name: str  # the key of its result in the verification's checks

    @abstractmethod
    def runs_at(self, level: str) -> bool:
        """Whether the check runs when the export is verified at `level`."""

    @abstractmethod
    def run(self, destination: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int) -> dict[str, Any]:
        """Check the export at `destination` within `timeout_s` seconds, holding at most
        `memory_bound_bytes` above the checking process's start-up; its numbers."""

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

    def run(self, destination: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int) -> dict[str, Any]:
        """The reload's result, its memory (`startup_rss_bytes`, `peak_rss_bytes`) included."""
        return check_reload(destination, expected, timeout_s, memory_bound_bytes)

    def warning(self, result: dict[str, Any]) -> str | None:
        """Why the streamed reload declined to the keys check, when it did."""
        return result.get("reason")


CONSUMER_CHECKS: list[ConsumerCheck] = [TransformersReload()]


def run_consumer_checks(
    destination: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int,
    checks: Sequence[ConsumerCheck] = CONSUMER_CHECKS,
) -> dict[str, dict[str, Any]]:
    """Each of `checks` that runs at the export's level, in order: its result by its name."""
    return {
        check.name: check.run(destination, expected, timeout_s, memory_bound_bytes)
        for check in checks if check.runs_at(expected.level)
    }


def consumer_warnings(results: dict[str, dict[str, Any]], checks: Sequence[ConsumerCheck] = CONSUMER_CHECKS) -> list[str]:
    """The log lines the consumer checks' `results` call for."""
    return [warning for check in checks if check.name in results and (warning := check.warning(results[check.name]))]
