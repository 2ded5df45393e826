"""Figures from the JSONL files alone: DQSGD Figure 1 (curves), Figure 2 (accuracy vs ratio), bits/time.

Every figure is drawn from ``config.json`` + ``metrics.jsonl`` of the run directories under a root
(never from logs), with matplotlib's object API on the Agg canvas: no pyplot state, no display.
Curves are means over seeds, aligned on the step index, with a ± std band where two or more seeds
have a value at that step. Runs that cannot contribute to a panel (no test evaluation yet, no steps)
are left out of it and named in :func:`notes`; skipped steps (``loss`` null) are gaps, not zeros.
"""

from __future__ import annotations

import io
import math
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dqsgd.core.extras import require
from dqsgd.experiments.labels import name_points
from dqsgd.experiments.summary import RunSums, ordered_labels, aggregate, method_order, run_dirs, summary_of
from dqsgd.train.reader import read_facts, run_records
from dqsgd.train.runfiles import atomic_write

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def new_figure(**kw: Any) -> Figure:
    """A matplotlib ``Figure``, imported when one is drawn (the [plots] extra: without it,
    :class:`~dqsgd.core.extras.MissingExtraError`; the runs and tables need no matplotlib)."""
    return require("matplotlib.figure", "the report's figures").Figure(**kw)


FIG1_MAX_METHODS = 9  # above this, Figure 1 keeps only SGD, QSGD-* and DQSGD-* (as in the paper)
FIG1_FEW_EVALS = 5  # fewer evaluations than this: panel (a) shows points, says where, and joins them faintly


@dataclass(frozen=True)
class Run:
    """One (method, seed) run as arrays indexed by record (NaN where a step was skipped)."""

    method: str
    seed: int
    path: Path                   # the run directory
    facts: dict[str, Any]        # config.json
    summary: dict[str, Any]      # summarize_run(): the same numbers as the tables
    step: np.ndarray             # int step index per record
    loss: np.ndarray             # mean minibatch loss of the W workers; NaN if skipped/null
    bits: np.ndarray             # nominal uplink bits/coordinate; NaN if skipped
    up_bytes: np.ndarray         # uplink bytes of all workers (0 if skipped, as in the tables)
    eval_step: np.ndarray        # steps that carry a test evaluation
    eval_acc: np.ndarray
    times: dict[str, float]      # total compute_s / encode_s / decode_s

    @property
    def has_eval(self) -> bool:
        return self.eval_acc.size > 0


def _num(v: Any) -> float:
    return float("nan") if v is None or isinstance(v, str) else float(v)


def load_run(run_dir: Path) -> Run:
    """One run as arrays, its records streamed once (:func:`dqsgd.train.reader.run_records`: every
    number checked), the table's sums (:class:`RunSums`) gathered in the same pass."""
    facts = read_facts(run_dir)
    sums = RunSums()
    step, ev_step = array("q"), array("q")
    loss, bits, up, ev_acc = array("d"), array("d"), array("d"), array("d")
    times = dict.fromkeys(("compute_s", "encode_s", "decode_s"), 0.0)
    for r in run_records(run_dir, facts):
        sums.add(r)
        skipped = bool(r.get("skipped"))
        step.append(r["step"])
        loss.append(_num(r.get("loss")))
        bits.append(math.nan if skipped else _num(r.get("bits")))
        up.append(0.0 if skipped else float(r["up_bytes"]))
        for k in times:
            times[k] += r[k]
        if r.get("test_acc") is not None:
            ev_step.append(r["step"])
            ev_acc.append(float(r["test_acc"]))
    return Run(
        method=facts["method"], seed=int(facts["seed"]), path=run_dir, facts=facts, summary=summary_of(facts, sums),
        step=np.frombuffer(step, dtype=np.int64).astype(int), loss=np.frombuffer(loss), bits=np.frombuffer(bits),
        up_bytes=np.frombuffer(up), eval_step=np.frombuffer(ev_step, dtype=np.int64).astype(int),
        eval_acc=np.frombuffer(ev_acc), times=times,
    )


def load_runs(root: Path) -> list[Run]:
    """Every run under ``root``, in the config's ``[methods.*]`` order, then by seed."""
    runs = [load_run(d) for d in run_dirs(root)]
    order = ordered_labels([r.method for r in runs], method_order(root))
    return sorted(runs, key=lambda r: (order.index(r.method), r.seed))


def runs_of(src: Path | list[Run]) -> list[Run]:
    return load_runs(Path(src)) if isinstance(src, (str, Path)) else list(src)


def methods_of(runs: list[Run]) -> list[str]:
    return list(dict.fromkeys(r.method for r in runs))


def notes(runs: list[Run]) -> list[str]:
    """What the figures leave out, and why (one line each); [] when nothing is left out."""
    out = []
    for r in runs:
        name = f"{r.method}/seed{r.seed}"
        if r.step.size == 0:
            out.append(f"{name}: no steps recorded yet; left out of every figure")
        elif not r.has_eval:
            out.append(f"{name}: no test evaluation yet; left out of the accuracy panels and Figure 2")
        n_nan = int(np.isnan(r.loss).sum())
        if n_nan:
            out.append(f"{name}: {n_nan} step(s) with no loss (skipped or non-finite): left out of the loss curve at those steps")
    return out


def method_colors(labels: list[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {m: cmap(i % cmap.N) for i, m in enumerate(labels)}


_STYLES = ("-", "--", "-.", ":")  # methods often coincide (same width): line styles keep them apart


def _by_step(runs: list[Run], values: list[np.ndarray], steps: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeds × steps matrix (NaN where absent) → (steps present, mean, std; std NaN below 2 seeds).

    The columns are the steps some run records (not 0..max step): the memory follows the records,
    whatever step numbers they carry."""
    x = np.unique(np.concatenate([np.asarray(s, dtype=np.int64) for s in steps])) if steps else np.zeros(0, np.int64)
    mat = np.full((len(runs), x.size), np.nan)
    for i, (v, s) in enumerate(zip(values, steps)):
        mat[i, np.searchsorted(x, s)] = v
    cnt = (~np.isnan(mat)).sum(0)
    keep = cnt > 0
    tot = np.nansum(mat, 0)
    mean = np.where(keep, tot / np.maximum(cnt, 1), np.nan)
    dev = np.nansum((mat - mean) ** 2, 0)
    std = np.where(cnt > 1, np.sqrt(dev / np.maximum(cnt - 1, 1)), np.nan)
    return x[keep], mean[keep], std[keep]


def _curve(ax: Axes, runs: list[Run], values: list[np.ndarray], steps: list[np.ndarray], color: Any,
           label: str, marker: str | None = None, ls: str = "-", ms: float = 3, lw: float = 1.4) -> None:
    x, m, s = _by_step(runs, values, steps)
    if x.size == 0:
        return
    ax.plot(x, m, color=color, label=label, lw=lw, marker=marker, ms=ms, ls=ls)
    band = ~np.isnan(s)
    if band.any():
        ax.fill_between(x[band], (m - s)[band], (m + s)[band], color=color, alpha=0.2, lw=0)


def moving_average(v: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` records, ignoring NaN (NaN only where the whole window is NaN)."""
    if window <= 1 or v.size == 0:
        return v.copy()
    ok = ~np.isnan(v)
    csum = np.concatenate([[0.0], np.cumsum(np.where(ok, v, 0.0))])
    ccnt = np.concatenate([[0], np.cumsum(ok)])
    lo = np.maximum(np.arange(v.size) + 1 - window, 0)
    hi = np.arange(v.size) + 1
    cnt = ccnt[hi] - ccnt[lo]
    return np.where(cnt > 0, (csum[hi] - csum[lo]) / np.maximum(cnt, 1), np.nan)


def fig1_methods(labels: list[str]) -> list[str]:
    """All methods when few; else SGD, fixed-width QSGD and DQSGD, as in the paper's Figure 1."""
    if len(labels) <= FIG1_MAX_METHODS:
        return labels
    return [m for m in labels if m == "sgd" or m.startswith("qsgd") or m.startswith("dqsgd")]


def footer_notes(fig: Figure, lines: list[str]) -> None:
    """The notes under the figure, as its super-x-label so that the constrained layout makes room for them."""
    if lines:
        shown = lines[:4] + ([f"... and {len(lines) - 4} more (see report.md)"] if len(lines) > 4 else [])
        fig.supxlabel("Left out: " + "\n".join(shown), fontsize=7, x=0.01, ha="left")


def figure1(src: Path | list[Run], out: Path) -> Path:
    """DQSGD Figure 1: (a) test accuracy, (b) smoothed training loss, (c) bits per iteration, (d) cumulative MB up."""
    return save_figure(draw_figure1(runs_of(src)), out)


def draw_figure1(all_runs: list[Run]) -> Figure:
    """The Figure 1 object (see :func:`figure1`)."""
    runs = [r for r in all_runs if r.step.size]
    labels = fig1_methods(methods_of(runs))
    color = method_colors(methods_of(runs))
    n_steps = max((int(r.step.max()) + 1 for r in runs), default=1)
    window = max(1, min(50, n_steps // 25))
    fig = new_figure(figsize=(12, 8.5), layout="constrained")
    (a, b), (c, d) = fig.subplots(2, 2)
    wide = []
    evals = sorted({int(s) for r in runs if r.method in labels for s in r.eval_step})
    few = len(evals) < FIG1_FEW_EVALS  # the points, large, on a faint dotted line: not a measured trajectory
    for i, m in enumerate(labels):
        rs = [r for r in runs if r.method == m]
        ev = [r for r in rs if r.has_eval]
        st = dict(color=color[m], label=_label(m, len(rs)), ls=_STYLES[i % len(_STYLES)])
        if ev:
            _curve(a, ev, [100 * r.eval_acc for r in ev], [r.eval_step for r in ev], marker="o",
                   **{**st, "label": _label(m, len(ev)), **(dict(ls=":", ms=7, lw=0.8) if few else {})})
        _curve(b, rs, [moving_average(r.loss, window) for r in rs], [r.step for r in rs], **st)
        if min((float(np.nanmin(r.bits)) for r in rs if np.isfinite(r.bits).any()), default=math.inf) >= 32:
            wide.append(m)
        else:
            _curve(c, rs, [moving_average(r.bits, window) for r in rs], [r.step for r in rs], **st)
        _curve(d, rs, [np.cumsum(r.up_bytes) / 1e6 for r in rs], [r.step for r in rs], **st)
    a.set(title="(a) test accuracy" + (f": {len(evals)} evaluation{'s' if len(evals) != 1 else ''} (step "
                                       f"{', '.join(map(str, evals))}), nothing measured between them" if few else ""),
          xlabel="step", ylabel="test accuracy (%)")
    b.set(title=f"(b) training loss{_smoothed(window)}",
          xlabel="step", ylabel="mean minibatch loss of the W workers")
    c.set(title=f"(c) bits per iteration{_smoothed(window)}", xlabel="step", ylabel="nominal uplink bits / coordinate")
    if wide:  # full precision would squash the quantized widths (2..8) against the bottom of the axis
        c.text(0.99, 0.98, f"not drawn (32-bit floats, no quantization): {', '.join(wide)}", transform=c.transAxes,
               ha="right", va="top", fontsize=7, color="0.3")
    d.set(title="(d) cumulative uplink communication (measured)", xlabel="step",
          ylabel="uplink MB, all W workers (payload lengths)")
    for ax in (a, b, c, d):
        ax.grid(alpha=0.3)
    if b.has_data():  # one legend for the four panels (every method has a loss curve), outside them
        fig.legend(*b.get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    fig.suptitle(figure_title(runs, "Figure 1: QSGD vs DQSGD") + "; mean over seeds, band = ± std")
    footer_notes(fig, notes(all_runs))
    return fig


def _smoothed(window: int) -> str:
    return f" (trailing mean over {window} steps)" if window > 1 else ""


def _label(method: str, seeds: int) -> str:
    return f"{method} ({seeds} seed{'s' if seeds > 1 else ''})"


def figure_title(runs: list[Run], head: str) -> str:
    if not runs:
        return head
    f = runs[0].facts
    stand = f" (stand-in for {f['stand_in_for']})" if f.get("stand_in_for") else ""
    return f"{head} — {f['dataset']}{stand}, {f['train_config']['model']}, W = {f['workers']}"


FIG2_BAND = 3.0  # pt below the median accuracy beyond which Figure 2 marks a method on the bottom edge


def figure2(src: Path | list[Run], out: Path) -> Path:
    """DQSGD Figure 2: test accuracy (mean ± std over seeds) vs compression ratio (log x): (a) the
    measured fixed-width uplink ratio, (b) the entropy-coded (auto) uplink ratio."""
    return save_figure(draw_figure2(runs_of(src)), out)


FIG2_PANELS = (
    ("measured_ratio", "(a) as sent (fixed-width)",
     "measured compression ratio = fp32 uplink bytes (4·d·W·steps) / uplink bytes sent (log scale)"),
    ("coded_ratio", "(b) entropy-coded (auto)",
     "entropy-coded ratio = fp32 uplink bytes / the same payloads coded with auto (log scale)"),
)


FAMILY_KEYS = ("scheme", "policy", "coding", "error_feedback", "aggregate", "per_tensor", "norm", "rounding")


def families(runs: list[Run]) -> dict[str, list[str]]:
    """Methods that differ only in their width or budget (``bits``, ``target_bits``, ``budget_bits``):
    Figure 2 joins the points of one family, never those of two (dqsgd and dqsgd-coded are two).
    Named by what the family is; a method whose config.json has no method config is its own."""
    out: dict[Any, list[str]] = {}
    for m in methods_of(runs):
        mc = next(r.facts for r in runs if r.method == m).get("method_config")
        key = tuple(mc.get(k) for k in FAMILY_KEYS) if isinstance(mc, dict) else ("label", m)
        out.setdefault(key, []).append(m)
    return {_family_name(key): ms for key, ms in out.items()}


def _family_name(key: tuple) -> str:
    if key[0] == "label":
        return key[1]
    scheme, policy, coding = key[:3]
    what = ("QSGD widths" if scheme == "uniform" and policy == "fixed" else
            f"{policy} budgets" if policy.startswith("dqsgd") else f"{scheme}/{policy}")
    return what + ("" if coding == "fixed" else f", {coding}-coded")


def draw_figure2(runs: list[Run]) -> Figure:
    """The Figure 2 object (see :func:`figure2`)."""
    ev = [r for r in runs if r.has_eval]
    labels = methods_of(runs)
    color = method_colors(labels)
    rows = {row["method"]: row for row in aggregate([r.summary for r in ev], order=labels)} if ev else {}
    fig = new_figure(figsize=(8.5, 11), layout="constrained")  # one above the other: each panel as wide as before
    left = []
    for ax, (key, name, xlabel) in zip(fig.subplots(2, 1), FIG2_PANELS):
        left += _figure2_panel(ax, rows, color, key, xlabel, families(ev))
        ax.set_title(name)
    fig.suptitle(figure_title(runs, "Figure 2: test accuracy vs compression ratio"))
    footer_notes(fig, [n for n in notes(runs) if "evaluation" in n or "no steps" in n] + left)
    return fig


def _figure2_panel(ax: Axes, rows: dict[str, dict[str, Any]], color: dict[str, Any], key: str, xlabel: str,
                   family: dict[str, list[str]]) -> list[str]:
    """Accuracy vs ``rows[m][key]`` on ``ax``; returns the notes on methods left out of it."""
    what = "measured ratio" if key == "measured_ratio" else "entropy-coded ratio"
    left = [f"{m}: {what} not finite" for m, row in rows.items()
            if not math.isfinite(row[key]) and not (key == "coded_ratio" and math.isnan(row[key]))]
    pts = {m: row for m, row in rows.items() if math.isfinite(row[key])}
    if rows and not pts and key == "coded_ratio":
        ax.text(0.5, 0.5, "no entropy-coded sizes recorded\n(runs from before train.coded_every, or coded_every = 0)",
                ha="center", va="center", transform=ax.transAxes, fontsize=9, color="0.3")
        ax.set(xlabel=xlabel, ylabel="test accuracy (%), mean ± std over seeds")
        return left
    for i, (name, members) in enumerate(family.items()):  # one line per family, through its own points only
        group = sorted((pts[m][key], 100 * pts[m]["test_acc_mean"]) for m in members if m in pts)
        if len(group) > 1:
            ax.plot(*zip(*group), color=color[members[0]], lw=1.2, ls=_STYLES[i % len(_STYLES)],
                    label=f"{name}, connected", zorder=1)
    # Far-off methods (signSGD: −8 pt) would squash the differences that matter into one line: the
    # axis keeps the points within FIG2_BAND pt of the median; the others sit on the bottom edge, marked.
    ys = [100 * row["test_acc_mean"] for row in pts.values() if math.isfinite(row["test_acc_mean"])]
    mid = float(np.median(ys)) if ys else 0.0
    low = {m for m, row in pts.items() if 100 * row["test_acc_mean"] < mid - FIG2_BAND}
    for m, row in pts.items():
        x, y, e = row[key], 100 * row["test_acc_mean"], 100 * row["test_acc_std"]
        if m in low:
            continue
        ax.errorbar([x], [y], yerr=[e if row["seeds"] > 1 else 0.0], fmt="o", color=color[m], capsize=3, zorder=2)
    if low:
        kept = [100 * (row["test_acc_mean"] - row["test_acc_std"]) for m, row in pts.items() if m not in low]
        bottom = min(kept) - 0.3
        ax.set_ylim(bottom=bottom)
        for m in sorted(low):
            row = pts[m]
            ax.plot([row[key]], [bottom], marker="v", color=color[m], clip_on=False, zorder=3)
            ax.annotate(f"{m}: {100 * row['test_acc_mean']:.2f}% (below the axis)", (row[key], bottom),
                        textcoords="offset points", xytext=(-10, 6), fontsize=7, ha="right")
    ax.set_xscale("log")
    _ratio_ticks(ax, [row[key] for row in pts.values()])
    name_points(ax, [(m, row[key], 100 * row["test_acc_mean"]) for m, row in pts.items() if m not in low])
    ax.set(xlabel=xlabel, ylabel="test accuracy (%), mean ± std over seeds")
    ax.grid(alpha=0.3, which="both")
    if any(line.get_label().endswith("connected") for line in ax.get_lines()):
        ax.legend(fontsize=7, loc="best")
    return left


def _ratio_ticks(ax: Axes, ratios: list[float]) -> None:
    """Plain numbers at the powers of two that span the ratios (a log axis alone labels only 10^0, 10^1)."""
    from matplotlib.ticker import NullFormatter

    if not ratios:
        return
    # a 1% slack: fp32 SGD's measured ratio is just below 1 (headers), and needs no 0.5 tick
    lo, hi = math.floor(math.log2(min(ratios)) + 0.01), math.ceil(math.log2(max(ratios)) - 0.01)
    ticks = [2.0**k for k in range(lo, hi + 1)]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())


def figure3(src: Path | list[Run], out: Path) -> Path:
    """(a) how often each width was chosen, per method with varying widths; (b) time per method, split."""
    return save_figure(draw_figure3(runs_of(src)), out)


def draw_figure3(runs: list[Run]) -> Figure:
    """The Figure 3 object (see :func:`figure3`)."""
    labels = methods_of(runs)
    color = method_colors(labels)
    fig = new_figure(figsize=(12, 4.8), layout="constrained")
    a, b = fig.subplots(1, 2)
    varying = [m for m in labels if len({x for r in runs if r.method == m for x in r.bits[np.isfinite(r.bits)]}) > 1]
    width = 0.8 / max(1, len(varying))
    chosen: set[int] = set()
    for i, m in enumerate(varying):
        vals = np.concatenate([r.bits[np.isfinite(r.bits)] for r in runs if r.method == m]).astype(int)
        ks, cnt = np.unique(vals, return_counts=True)
        a.bar(ks + (i - (len(varying) - 1) / 2) * width, 100 * cnt / cnt.sum(), width=width, color=color[m], label=m)
        chosen.update(int(k) for k in ks)
    if not varying:
        a.text(0.5, 0.5, "no method changed its width during training", ha="center", va="center", transform=a.transAxes)
    else:
        a.legend(fontsize=7)
        a.set_xticks(sorted(chosen))  # widths are integers: one tick under each group of bars, none between
    a.set(title="(a) widths chosen (all seeds' steps)", xlabel="nominal uplink bits / coordinate", ylabel="% of steps")
    parts = (("compute_s", "compute (gradients)"), ("encode_s", "encode"), ("decode_s", "aggregate + decode + update"))
    y = np.arange(len(labels))
    base = np.zeros(len(labels))
    for k, (key, name) in enumerate(parts):
        v = np.array([np.mean([r.times[key] for r in runs if r.method == m]) for m in labels])
        b.barh(y, v, left=base, color=f"C{k}", label=name)
        base += v
    b.set_yticks(y, labels)
    b.invert_yaxis()
    b.set(title="(b) time per run by phase, mean over seeds", xlabel="seconds (all W simulated workers, one process)")
    b.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)  # below the axis: bars start at 0
    fig.suptitle(figure_title(runs, "Figure 3: widths chosen and time per phase"))
    return fig


def save_figure(fig: Figure, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format=out.suffix.lstrip(".") or "png", dpi=110, metadata={"Software": None})
    atomic_write(out, buf.getvalue())  # never through a link planted in the output directory
    return out
