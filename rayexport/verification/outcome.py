"""The verification's outcome, as the manifest and the report hold it, and `verify_export`,
which runs every check on an export from this one process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rayexport.common.levels import NONE
from rayexport.storage.store import Store
from rayexport.verification.consumers import run_consumer_checks
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.files import check_files
from rayexport.verification.reading import READ_AHEAD
from rayexport.verification.structure import conclude


def verification_outcome(
    level: str, file_checks: dict[str, Any] | None, consumer_results: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """`passed`, the `level` and the `checks`: the file checks' numbers and each consumer
    check's result under its name; with no file checks (`--verify none`) only that nothing
    was checked."""
    if file_checks is None:
        return {"passed": None, "level": NONE}
    return {"passed": True, "level": level, "checks": {**file_checks, **consumer_results}}


def verify_export(store: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int) -> dict[str, Any]:
    """Run every check on the export at `store` from this process (reading its files a few at a
    time in threads, then the consumer checks); raise VerificationError on the first failure,
    else return the outcome. An export's own verification spreads the file checks over its
    writers instead (rayexport.orchestration.group)."""
    with ThreadPoolExecutor(READ_AHEAD) as pool:
        checks = [part for parts in pool.map(lambda name: check_files(store, [name], expected), sorted(expected.files)) for part in parts]
    found = conclude(store, checks, expected)
    return verification_outcome(expected.level, found, run_consumer_checks(store, expected, timeout_s, memory_bound_bytes))
