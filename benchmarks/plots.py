"""The benchmarks' pictures, drawn from their measurements (matplotlib, PNG), so that
docs/performance.md shows what the last run of each script measured.

    size_plot(rows, path)      wall time and peak memory against checkpoint size, one line per tool
    phase_plot(runs, path)     one stacked bar per run: the seconds of each phase

Each script calls these after printing its tables (`--plots DIR`, default docs/images)."""

from __future__ import annotations

import os
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS_IMAGES = os.path.join(HERE, "..", "docs", "images")
MiB = 2**20


@dataclass(frozen=True)
class SizePoint:
    """One run at one checkpoint size: which tool, its wall seconds and its largest process."""

    tool: str
    size_bytes: int
    wall_s: float
    peak_bytes: int | None = None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as pyplot

    return pyplot


def size_plot(points: list[SizePoint], path: str, title: str) -> str:
    """Two panels side by side, wall seconds and peak memory (MiB) against checkpoint size (GB),
    a line per tool in the order the points name them; returns `path`."""
    pyplot = _pyplot()
    figure, (walls, memory) = pyplot.subplots(1, 2, figsize=(11, 4.2))
    colours = pyplot.get_cmap("tab10")
    for number, tool in enumerate(dict.fromkeys(point.tool for point in points)):
        style = {"marker": "o", "label": tool, "color": colours(number % 10)}  # a tool is one colour in both panels
        mine = sorted((point for point in points if point.tool == tool), key=lambda point: point.size_bytes)
        walls.plot([point.size_bytes / 1e9 for point in mine], [point.wall_s for point in mine], **style)
        peaks = [(point.size_bytes / 1e9, point.peak_bytes / MiB) for point in mine if point.peak_bytes]
        if peaks:
            memory.plot(*zip(*peaks), **style)
    walls.set(xlabel="checkpoint size (GB)", ylabel="wall time (s)", title="wall time")
    memory.set(xlabel="checkpoint size (GB)", ylabel="largest process (MiB)", title="peak memory")
    for axes in (walls, memory):
        axes.grid(alpha=0.3)
        axes.set_xlim(left=0)
        axes.set_ylim(bottom=0)
        axes.legend(fontsize="small")
    figure.suptitle(title, y=1.03)
    return _save(figure, path)


def phase_plot(runs: dict[str, dict[str, float]], path: str, title: str, order: tuple[str, ...] = ()) -> str:
    """One horizontal bar per run (in the given order), stacked from its phases' seconds: the
    phases in `order` first, in that order, then any other in the order the runs name them;
    returns `path`."""
    pyplot = _pyplot()
    named = dict.fromkeys(phase for seconds in runs.values() for phase in seconds)
    phases = [phase for phase in order if phase in named] + [phase for phase in named if phase not in order]
    figure, axes = pyplot.subplots(figsize=(11, max(2.6, 0.8 + 0.55 * len(runs))))
    labels = list(runs)[::-1]  # the first run on top
    colours = pyplot.get_cmap("tab20")
    left = [0.0] * len(labels)
    for number, phase in enumerate(phases):
        widths = [runs[label].get(phase, 0.0) for label in labels]
        axes.barh(labels, widths, left=left, color=colours(number % 20), label=phase)
        left = [start + width for start, width in zip(left, widths)]
    for row, total in enumerate(left):
        axes.text(total, row, f" {total:.1f} s", va="center", fontsize="small")
    axes.set(xlabel="seconds", title=title)
    axes.set_xlim(right=max(left) * 1.12 if left else 1)
    axes.grid(axis="x", alpha=0.3)
    axes.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(figure, path)


def _save(figure, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as pyplot

    pyplot.close(figure)
    return path
