"""Waiting on Ray with a deadline and fail-fast: one step's time limit (--timeout, or less when
the job's --deadline is nearer), and a wait that ends at the first error or death among the
references, so one dead worker never leaves the others blocked."""

from __future__ import annotations

import time

from rayexport.common.errors import ExportError, one_line
from rayexport.orchestration.options import ExportOptions


def step_limit(options: ExportOptions, job_deadline: float) -> tuple[float, str]:
    """Seconds one step may take: --timeout, or less when the whole job's --deadline is nearer."""
    remaining = job_deadline - time.monotonic()
    deadline = f"--deadline {options.deadline_s:.0f} s for the whole export"
    if remaining <= 0:
        raise ExportError(f"export timed out: past its {deadline}")
    if remaining < options.timeout_s:
        return remaining, deadline
    return options.timeout_s, "--timeout"


def actor_death(references: list, wait_s: float):
    """The first RayActorError among `references` that arrives within `wait_s`, else None."""
    import ray
    from ray.exceptions import RayActorError

    ready, _ = ray.wait(list(references), num_returns=len(references), timeout=wait_s)
    for reference in ready:
        try:
            ray.get(reference, timeout=0)
        except RayActorError as error:
            return error
        except Exception:  # noqa: BLE001 - other failures are reported by the caller
            continue
    return None


def all_succeed(references: list, wait_s: float) -> bool:
    """Whether every reference finishes without error within `wait_s` seconds."""
    import ray

    done, _ = ray.wait(references, num_returns=len(references), timeout=wait_s)
    try:
        ray.get(done, timeout=0)
    except Exception:  # noqa: BLE001 - a dead actor, a failed call: not done
        return False
    return len(done) == len(references)


def cancel_unfinished(references: list) -> None:
    """Force-cancel the tasks of `references` that have not finished. A finished task is never
    cancelled: Ray 2.60's driver can abort (`Check failed: ... Tried to complete task that was
    not pending`) when a force-cancel crosses the reply of a task that just failed."""
    import ray

    _, pending = ray.wait(list(references), num_returns=len(references), timeout=0)
    for reference in pending:
        ray.cancel(reference, force=True)


def get_all(references: list, limit: tuple[float, str], on_failure, describe_death=None) -> list:
    """Wait for every reference; on the first error or when the step's time `limit` (seconds,
    and the option that set it) runs out, call `on_failure` and raise, so one dead worker ends
    the export at once instead of leaving others blocked. `describe_death` gives the line for a
    dead or unreachable worker's RayActorError (default: the first line of Ray's own text)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    describe = describe_death or (lambda error: str(error).splitlines()[0])
    timeout_s, source = limit
    deadline = time.monotonic() + timeout_s
    pending = list(references)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise GetTimeoutError(f"no answer within {timeout_s:.0f} s ({source})")
            ray.get(ready[0])
        return ray.get(list(references))
    except RayTaskError as error:
        cause = error.cause
        if isinstance(cause, ExportError):
            on_failure()
            raise type(cause)(*cause.args) from None
        # A worker whose peer died fails its collective ("connection closed by peer") and may
        # answer before the dead worker's own error does: name the death when it follows.
        died = actor_death(references, wait_s=5)
        message = f"an export worker died: {describe(died)}" if died is not None else (
            f"an export worker failed: {type(cause).__name__}: {one_line(cause)}"
        )
        on_failure()
        raise ExportError(message) from None
    except RayActorError as error:
        message = f"an export worker died: {describe(error)}"
        on_failure()
        raise ExportError(message) from None
    except GetTimeoutError as error:
        on_failure()
        raise ExportError(f"export timed out: {error}") from None
