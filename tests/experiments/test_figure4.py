"""Figure 4 of the report: accuracy against total bytes, with synchronous SGD's 95% band.

The fake runs' bytes and accuracies are chosen by hand in fake_runs.py: every number below is
recomputed from those definitions (D = 1000 coordinates, W = 4 workers, 40 steps, fp32 downlink).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest

from dqsgd.experiments.plot_bytes import bytes_points, draw_figure4, figure4, times_fewer
from dqsgd.experiments.plots import load_runs

from fake_runs import D, STEPS, W, write_run, write_toml

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DOWN = W * 4 * D  # the fake runs' fp32 downlink, every step
# total bytes of one run: uplink (codes + a 16-byte header per worker) + downlink, every step
TOTAL = {"sgd": STEPS * (W * (4 * D + 16) + DOWN),
         "qsgd-4bit": STEPS * (W * (D // 2 + 16) + DOWN),
         "dqsgd": STEPS // 2 * (W * (D // 2 + 16) + DOWN) + STEPS // 2 * (W * (5 * D // 8 + 16) + DOWN)}
T975_1 = 12.706  # Student t, 1 degree of freedom (two seeds)


def _band(ax):
    """The y-range of every patch drawn across the axes, in data units."""
    out = []
    for p in ax.patches:
        ys = p.get_patch_transform().transform(p.get_path().vertices)[:, 1]
        out.append((float(ys.min()), float(ys.max())))
    return out


def _points(ax):
    """(x, y, filled) of every point marker."""
    return sorted((float(ln.get_xdata()[0]), float(ln.get_ydata()[0]), ln.get_markerfacecolor() != "white")
                  for ln in ax.get_lines() if ln.get_marker() == "o")


def test_points_are_mean_total_bytes_and_accuracy_intervals(root: Path) -> None:
    pts = bytes_points(load_runs(root))
    assert list(pts) == ["sgd", "qsgd-4bit", "dqsgd"]  # the config's order
    for m, (x, acc) in pts.items():
        assert x == TOTAL[m]  # the same on both seeds
        assert acc.n == 2
    sgd = pts["sgd"][1]  # seeds at 0.900 and 0.910: mean 0.905, sd 0.01/√2, half-width t·sd/√2 = t·0.005
    assert sgd.mean == pytest.approx(0.905, abs=1e-12)
    assert sgd.half == pytest.approx(T975_1 * 0.005, rel=1e-9)


def test_figure_draws_sgd_band_line_top_axis_and_points(root: Path) -> None:
    fig = draw_figure4(load_runs(root))
    ax = fig.axes[0]
    lo, hi = 100 * (0.905 - T975_1 * 0.005), 100 * (0.905 + T975_1 * 0.005)
    assert _band(ax) == [pytest.approx((lo, hi), rel=1e-9)]
    dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert len(dashed) == 1 and np.allclose(dashed[0].get_ydata(), 90.5)
    assert ax.get_xscale() == "log"
    # every method at its total bytes and mean accuracy, filled (two seeds)
    want = sorted((float(TOTAL[m]), 100 * a, True) for m, a in
                  (("sgd", 0.905), ("qsgd-4bit", 0.9035), ("dqsgd", 0.875)))
    assert [(x, pytest.approx(y), f) for x, y, f in _points(ax)] == want
    # the top axis reads the bytes as × fewer than sgd: sgd's own point at 1, half its bytes at 2
    assert [c.get_xlabel() for c in ax.child_axes] == ["× fewer total bytes than sgd"]


def test_times_fewer_is_its_own_inverse_and_inf_at_zero() -> None:
    ref = float(TOTAL["sgd"])
    assert times_fewer(ref, np.array([ref, ref / 2, ref / 1000])) == pytest.approx([1.0, 2.0, 1000.0])
    assert times_fewer(ref, times_fewer(ref, np.array([3.0, 7.5]))) == pytest.approx([3.0, 7.5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib probes 0: no division warning, inf
        assert math.isinf(times_fewer(ref, np.array([0.0]))[0])


def test_without_sgd_no_band_and_one_seed_hollow(tmp_path: Path) -> None:
    root = tmp_path / "fake-table1"
    write_toml(root)
    write_run(root, "qsgd-4bit", 0, final_acc=0.90)
    write_run(root, "dqsgd", 0, final_acc=0.88)
    write_run(root, "dqsgd", 1, final_acc=0.87)
    ax = draw_figure4(load_runs(root)).axes[0]
    assert _band(ax) == [] and not ax.child_axes
    assert not [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert _points(ax) == [(float(TOTAL["qsgd-4bit"]), pytest.approx(90.0), False),
                           (float(TOTAL["dqsgd"]), pytest.approx(87.5), True)]


def test_run_without_evaluation_left_out_and_png_written(root: Path) -> None:
    write_run(root, "qsgd-4bit", 2, final_acc=None, evals=False)
    pts = bytes_points(load_runs(root))
    assert pts["qsgd-4bit"][1].n == 2  # the unevaluated seed is not a point of the mean
    out = figure4(root, root / "fig4.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
