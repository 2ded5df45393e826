"""Figure 4 of ``dqsgd report``: test accuracy against the total bytes of a run, with synchronous SGD's band.

Total bytes = every payload of every worker, uplink + downlink + side messages (the ``up_bytes``,
``down_bytes`` and ``side_bytes`` the tables sum), a mean over the method's seeds, on a log axis. Each
method's point is its mean final test accuracy with its 95% Student-t interval over seeds
(:func:`dqsgd.experiments.stats.paired_interval` of the accuracies; a method run on one seed is a hollow
point without a bar). When the tree holds the baseline ``sgd`` (synchronous SGD, the tables' reference),
its mean accuracy is a line and its 95% interval over seeds a band across the axis, and the axis on top
reads the bytes as "× fewer than synchronous SGD" (its mean total bytes divided by the point's).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dqsgd.experiments.labels import name_points
from dqsgd.experiments.plots import (Run, figure_title, footer_notes, method_colors, methods_of, new_figure, notes, runs_of,
                                    save_figure)
from dqsgd.experiments.stats import Interval, paired_interval

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["BASELINE", "bytes_points", "draw_figure4", "figure4", "times_fewer"]

BASELINE = "sgd"  # the method whose accuracy is the band (the tables' reference, summary.aggregate's baseline)


def total_bytes(run: Run) -> int:
    """Every payload of the run: uplink + downlink + side messages, all workers."""
    s = run.summary
    return int(s["up_bytes"]) + int(s["down_bytes"]) + int(s.get("side_bytes", 0))


def times_fewer(ref: float, x: Any) -> Any:
    """``ref / x`` elementwise, inf at 0 without a warning (matplotlib probes the axis' ends)."""
    with np.errstate(divide="ignore"):
        return ref / np.asarray(x, dtype=float)


def bytes_points(runs: list[Run]) -> dict[str, tuple[float, Interval]]:
    """Per method with a test evaluation: (mean total bytes over its seeds, its accuracy's 95% interval)."""
    out = {}
    for m in methods_of(runs):
        rs = [r for r in runs if r.method == m and r.has_eval and r.step.size]
        if rs:
            out[m] = (statistics.fmean(total_bytes(r) for r in rs), paired_interval([r.summary["test_acc"] for r in rs]))
    return out


def figure4(src: Path | list[Run], out: Path) -> Path:
    """Test accuracy against total bytes (log x), with synchronous SGD's 95% band (see the module)."""
    return save_figure(draw_figure4(runs_of(src)), out)


def draw_figure4(runs: list[Run]) -> Figure:
    """The Figure 4 object (see :func:`figure4`)."""
    pts = {m: p for m, p in bytes_points(runs).items() if p[0] > 0}
    color = method_colors(methods_of(runs))
    fig = new_figure(figsize=(8.5, 5.5), layout="constrained")
    ax = fig.subplots()
    base = pts.get(BASELINE)
    if base is not None:
        ref, acc = base
        ax.axhline(100 * acc.mean, color="0.4", lw=0.8, ls="--", zorder=0)
        if acc.n > 1:
            ax.axhspan(100 * (acc.mean - acc.half), 100 * (acc.mean + acc.half), color="0.85", zorder=0,
                       label=f"{BASELINE} (synchronous): mean and 95% interval over {acc.n} seeds")
        top = ax.secondary_xaxis("top", functions=(lambda x: times_fewer(ref, x), lambda r: times_fewer(ref, r)))
        top.set_xlabel(f"× fewer total bytes than {BASELINE}")
    for m, (x, acc) in pts.items():
        half = 100 * acc.half if acc.n > 1 and math.isfinite(acc.half) else 0.0
        ax.errorbar([x], [100 * acc.mean], yerr=[half], fmt="o", color=color[m], capsize=3, zorder=2,
                    mfc=color[m] if acc.n > 1 else "white")
    ax.set_xscale("log")
    name_points(ax, [(m, x, 100 * acc.mean) for m, (x, acc) in pts.items()])
    ax.set(xlabel="total bytes, all workers, uplink + downlink + side messages (mean over seeds, log scale)",
           ylabel="test accuracy (%), mean and 95% interval over seeds")
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(figure_title(runs, "Figure 4: test accuracy vs total bytes"))
    footer_notes(fig, [n for n in notes(runs) if "evaluation" in n or "no steps" in n])
    return fig


def caption() -> str:
    """The report's caption of Figure 4."""
    return ("Figure 4: test accuracy (mean and 95% Student-t interval over seeds; hollow: one seed) vs total bytes "
            f"(uplink + downlink + side messages of every worker, log scale); where the runs include `{BASELINE}`, "
            "its mean is the dashed line, its 95% interval the grey band, and the top axis reads × fewer total "
            f"bytes than `{BASELINE}`.")
