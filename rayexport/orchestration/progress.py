"""The export's one progress bar, on the driver, fed by the workers' counters.

Each worker counts the bytes it has spooled, loaded, scanned, sent, written and verified, and
what it expects to (`WorkerProgress`, a step adding to both as it starts); the driver asks every
worker for its counters now and then and shows their sums (`ExportProgress`): on a terminal as
one bar of the current phase's bytes against that phase's total, with rate and time left, and
the other counters beside it; elsewhere (a Ray job's log, CI) as a log line at most every LINE_INTERVAL_S.
No worker draws a bar of its own."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Iterator

log = logging.getLogger(__name__)

# What each phase's bar counts (the phases without bytes, such as the reload, show their time).
KINDS = ("spooled", "loaded", "scanned", "sent", "written", "verified")
PHASE_COUNTS = {
    "load": ("spooled", "loaded"), "source_scan": ("scanned",), "transfer": ("written",), "verify_files": ("verified",),
}
# How often the driver asks the workers on a terminal, and how often a log line is written elsewhere.
POLL_S = 0.5
LINE_INTERVAL_S = 5.0


@dataclass
class WorkerProgress:
    """One worker's bytes done and expected, by kind (KINDS). A step adds what it will move to
    `expected` as it starts, then each count to `done` as it goes; each kind has one writer
    thread, so no lock is needed."""

    done: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    expected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def expect(self, kind: str, count: int) -> None:
        self.expected[kind] += count

    def counter(self, kind: str) -> Callable[[int], None]:
        """What a step calls with each count of bytes of `kind` it moves."""
        def advance(count: int) -> None:
            self.done[kind] += count

        return advance

    def snapshot(self) -> "WorkerProgress":
        return dataclasses.replace(self, done=dict(self.done), expected=dict(self.expected))


def summed(snapshots: list[WorkerProgress]) -> WorkerProgress:
    """Every worker's counters added up."""
    total = WorkerProgress()
    for snapshot in snapshots:
        for kind in KINDS:
            total.done[kind] += snapshot.done.get(kind, 0)
            total.expected[kind] += snapshot.expected.get(kind, 0)
    return total


def phase_bytes(progress: WorkerProgress, phase: str) -> tuple[int, int]:
    """The bytes a phase's bar shows: done and expected, of the kinds it counts (0, 0 for a
    phase without bytes)."""
    kinds = PHASE_COUNTS.get(phase, ())
    return sum(progress.done[kind] for kind in kinds), sum(progress.expected[kind] for kind in kinds)


def counters_text(progress: WorkerProgress) -> str:
    """`loaded 2.40/2.40 GB, sent 600 MB, ...`: the counters that have moved, for the bar and the log."""
    parts = []
    for kind in KINDS:
        done, expected = progress.done[kind], progress.expected[kind]
        if done or expected:
            parts.append(f"{kind} {_fraction(done, expected) if expected else _size(done)}")
    return ", ".join(parts)


def _fraction(done: int, expected: int) -> str:
    """`1.2/2.4 GB`, or `900 MB/2.4 GB` where the units differ: short enough that a bar with
    every counter fits a 120-column terminal."""
    done_text, expected_text = _size(done), _size(expected)
    done_number, _, done_unit = done_text.partition(" ")
    if done_unit == expected_text.partition(" ")[2]:
        return f"{done_number}/{expected_text}"
    return f"{done_text}/{expected_text}"


def progress_line(phase: str, progress: WorkerProgress, seconds: float) -> str:
    """The log line for a phase `seconds` in: its bytes, share, rate and time left, then every
    counter."""
    done, expected = phase_bytes(progress, phase)
    counters = counters_text(progress)
    if not expected:
        return f"{phase}: {seconds:.0f} s" + (f" ({counters})" if counters else "")
    rate = done / max(seconds, 1e-3)
    left = f", about {(expected - done) / rate:.0f} s left" if rate > 0 and done < expected else ""
    return f"{phase}: {_size(done)} of {_size(expected)} ({100 * done / expected:.0f}%), {_size(rate)}/s{left} ({counters})"


def _size(count: float) -> str:
    """Bytes as a person reads them: 118 kB, 2.4 GB (powers of 1000, as the bar shows them)."""
    unit = "B"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if count < 999.5:
            break
        count /= 1000
    return f"{count:.3g} {unit}"


class ExportProgress:
    """The bar (or log lines) of one export, fed by `ask()` (every worker's counters, or None
    when they cannot be had now) from a thread of its own. `phase(name)` starts a phase."""

    def __init__(self, ask: Callable[[], list[WorkerProgress] | None], stream: IO[str] | None = None) -> None:
        self.ask = ask
        self.stream = stream or sys.stderr
        self.terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        self.name = ""
        self.started = time.monotonic()
        self.last = WorkerProgress()
        self.bar = None
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._poll, name="rayexport-progress", daemon=True)

    def __enter__(self) -> "ExportProgress":
        self.thread.start()
        return self

    def __exit__(self, failed, *exc_info) -> None:
        self.stopped.set()
        self.thread.join()
        if failed is None:  # the last counts; a failed export ends at once
            self._refresh(self.ask())
        if self.bar is not None:
            self.bar.close()

    def phase(self, name: str) -> None:
        """Show phase `name` from now (its bar starts from its bytes done so far)."""
        with self.lock:
            self.name, self.started = name, time.monotonic()
            if self.terminal:
                if self.bar is None:
                    from tqdm import tqdm

                    self.bar = tqdm(unit="B", unit_scale=True, file=self.stream, dynamic_ncols=True, leave=True)
                self.bar.set_description_str(name, refresh=False)
                self._draw(new_phase=True)

    def _poll(self) -> None:
        interval = POLL_S if self.terminal else LINE_INTERVAL_S
        while not self.stopped.wait(interval):
            snapshots = self.ask()
            self._refresh(snapshots)
            if not self.terminal and snapshots is not None and self.name:
                log.info("%s", progress_line(self.name, self.last, time.monotonic() - self.started))

    def _refresh(self, snapshots: list[WorkerProgress] | None) -> None:
        if snapshots is None:
            return
        with self.lock:
            self.last = summed(snapshots)
            if self.bar is not None and self.name:
                self._draw()

    def _draw(self, new_phase: bool = False) -> None:
        """The bar for the phase: its bytes against their total once the workers have said what
        they will move (a total that grows, with a later load step, keeps the phase's time); until
        then, and for a phase without bytes (the reload), its time alone."""
        done, expected = phase_bytes(self.last, self.name)
        timed = "{desc}: {elapsed}{postfix}" if not expected else None
        if new_phase or timed != self.bar.bar_format:
            self.bar.bar_format = timed
            self.bar.reset(total=expected or None)
        elif expected != self.bar.total:
            self.bar.total = expected
        self.bar.set_postfix_str(counters_text(self.last), refresh=False)
        self.bar.update(done - self.bar.n)
        self.bar.refresh()


@contextlib.contextmanager
def shown_progress(ask: Callable[[], list[WorkerProgress] | None], stream: IO[str] | None = None) -> Iterator[ExportProgress]:
    """`ExportProgress` for the block, with the driver's own log lines printed above a bar
    instead of through it."""
    with ExportProgress(ask, stream) as progress:
        if not progress.terminal:
            yield progress
            return
        from tqdm.contrib.logging import logging_redirect_tqdm

        with logging_redirect_tqdm():
            yield progress
