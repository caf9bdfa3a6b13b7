"""The protocol of a consumer check: one library users load an export with, loading it as they
will (see `consumers` for the list every verification runs)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from rayexport.storage.store import Store
from rayexport.verification.expected import ExpectedExport


class ConsumerCheck(ABC):
    """One consumer of the export, checked loading it; a failure raises VerificationError
    naming what the consumer could not load."""

    name: str  # the key of its result in the verification's checks

    @abstractmethod
    def runs_for(self, expected: ExpectedExport) -> bool:
        """Whether the check runs on an export verified as `expected` says (its level, the
        checks the user asked for)."""

    def gpus(self, expected: ExpectedExport) -> float:
        """The GPUs the check asks for where the cluster has some (0: it runs where the other
        checks run, on the exporter)."""
        return 0.0

    def prepare(self, cpus: int = 1) -> Any:
        """Start what the check can start before the export is written (its process, so that
        its imports overlap the export), to use `cpus` CPUs once it runs; `run` is handed it.
        None: nothing to start."""
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
