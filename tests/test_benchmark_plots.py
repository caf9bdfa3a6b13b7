"""benchmarks/plots.py, which the benchmark scripts draw docs/performance.md's pictures with:
each plot is a PNG of the size asked for, and the phases of a run stack to its total."""

from __future__ import annotations

import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from plots import SizePoint, phase_plot, size_plot  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as handle:
        header = handle.read(24)
    assert header[:8] == PNG_SIGNATURE, path
    return struct.unpack(">II", header[16:24])


def test_the_size_plot_is_a_png_with_a_panel_for_time_and_one_for_memory(tmp_path):
    points = [SizePoint("floor: cp -r", size, size / 3e8) for size in (10**9, 4 * 10**9)]
    points += [SizePoint("verl model_merger", size, size / 1e8, 2 * size) for size in (10**9, 4 * 10**9)]
    width, height = png_size(size_plot(points, str(tmp_path / "images" / "size.png"), "sizes"))
    assert width > 2 * height  # two panels side by side


def test_the_phase_plot_draws_a_bar_per_run_in_the_phases_order(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    drawn = []
    barh = pyplot.Axes.barh

    def recording(axes, labels, widths, left, **kwargs):
        drawn.append((kwargs["label"], list(labels), list(widths), list(left)))
        return barh(axes, labels, widths, left=left, **kwargs)

    pyplot.Axes.barh = recording
    try:
        path = phase_plot({"verl": {"merge": 17.0}, "rayexport": {"load": 2.0, "ray_start": 7.0, "transfer": 3.0}},
                          str(tmp_path / "phases.png"), "phases", order=("ray_start", "load", "transfer"))
    finally:
        pyplot.Axes.barh = barh
    assert png_size(path)[0] > 0
    assert [phase for phase, *_ in drawn] == ["ray_start", "load", "transfer", "merge"]
    ends = {label: [] for label in ("verl", "rayexport")}
    for _, labels, widths, left in drawn:
        for label, width, start in zip(labels, widths, left):
            ends[label].append(start + width)
    assert max(ends["rayexport"]) == 12.0 and max(ends["verl"]) == 17.0  # each bar is its phases' sum
