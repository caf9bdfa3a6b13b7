"""rayexport.orchestration.progress: the driver's one bar, fed by the workers' counters. Pure:
the workers' answers are made by hand, the terminal is a stream that says it is one."""

from __future__ import annotations

import io
import logging

from rayexport.orchestration import progress as progress_module
from rayexport.orchestration.progress import (
    ExportProgress, WorkerProgress, counters_text, phase_bytes, progress_line, shown_progress, summed,
)

GB = 10**9


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def worker(**done_expected: tuple[int, int]) -> WorkerProgress:
    counts = WorkerProgress()
    for kind, (done, expected) in done_expected.items():
        counts.expect(kind, expected)
        counts.counter(kind)(done)
    return counts


def test_the_workers_counters_add_up_and_each_phase_counts_its_own_bytes():
    total = summed([worker(loaded=(GB, GB), written=(GB // 2, GB)), worker(loaded=(GB, 2 * GB), sent=(GB // 4, GB // 4))])
    assert (total.done["loaded"], total.expected["loaded"]) == (2 * GB, 3 * GB)
    assert phase_bytes(total, "load") == (2 * GB, 3 * GB)
    assert phase_bytes(total, "transfer") == (GB // 2, GB)
    assert phase_bytes(total, "reload") == (0, 0)  # a phase without bytes
    assert counters_text(total) == "loaded 2/3 GB, sent 250/250 MB, written 500 MB/1 GB"


def test_a_log_line_gives_the_phases_share_rate_and_time_left():
    counts = worker(written=(GB // 2, GB))
    assert progress_line("transfer", counts, 5.0) == (
        "transfer: 500 MB of 1 GB (50%), 100 MB/s, about 5 s left (written 500 MB/1 GB)"
    )
    assert progress_line("reload", counts, 3.2) == "reload: 3 s (written 500 MB/1 GB)"


def test_on_a_terminal_one_bar_shows_each_phase_with_the_workers_counters():
    counts = [worker(loaded=(GB, GB)), worker(loaded=(GB // 2, GB))]
    terminal = Terminal()
    with ExportProgress(lambda: counts, terminal) as shown:
        shown.phase("describe_model")
        shown._refresh(counts)
        shown.phase("load")
        shown._refresh(counts)
        assert shown.bar.total == 2 * GB and shown.bar.n == 3 * GB // 2
        counts[1].counter("loaded")(GB // 2)
        shown.phase("reload")
    text = terminal.getvalue()
    assert "describe_model: 00:00" in text and "load:  75%" in text
    assert "reload: 00:00, loaded 2/2 GB" in text.rsplit("\r", 1)[-1]  # the last state drawn


def test_elsewhere_a_line_at_most_every_few_seconds_and_no_bar(caplog, monkeypatch):
    monkeypatch.setattr(progress_module, "LINE_INTERVAL_S", 0.05)
    counts = [worker(written=(GB // 4, GB))]
    stream = io.StringIO()
    caplog.set_level(logging.INFO, logger="rayexport")
    with shown_progress(lambda: counts, stream) as shown:
        shown.phase("transfer")
        import time

        time.sleep(0.3)
    assert stream.getvalue() == ""  # nothing drawn
    lines = [record.getMessage() for record in caplog.records if record.name == progress_module.__name__]
    assert lines and all(line.startswith("transfer: 250 MB of 1 GB (25%), ") for line in lines)


def test_a_worker_that_cannot_answer_skips_a_refresh():
    shown = ExportProgress(lambda: None, Terminal())
    with shown:
        shown.phase("load")
    assert shown.last.done == WorkerProgress().done
