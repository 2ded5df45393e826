"""The four figures of the theory checks (matplotlib, drawn without pyplot). Each caption names the command."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fig(w: float, h: float):
    from dqsgd.core.extras import require

    return require("matplotlib.figure", "the theory checks' figures").Figure(figsize=(w, h), layout="constrained")


def _label(ax, xlabel: str, ylabel: str, title: str, title_size: float, legend_size: float, log: bool = True) -> None:
    """Axis labels, a small title and a legend; a log y axis unless ``log`` is False."""
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=title_size)
    ax.legend(fontsize=legend_size)


def _save(fig, path: Path, cmd: str) -> None:
    """Write the figure with the command that made it as its caption."""
    fig.supxlabel(f"made by: {cmd}", fontsize=7, color="0.35")
    fig.savefig(path, dpi=110, metadata={"Software": None})


def plot_theorem2(res: dict[str, Any], path: Path, cmd: str) -> None:
    fig = _fig(7.5, 6.8)
    ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=[2.2, 1])
    for i, row in enumerate(res["isotropic"]):
        col = f"C{i}"
        N = [p["N"] for p in row["curve"]]
        ax.plot(N, [p["formula"] for p in row["curve"]], color=col, lw=1.5, label=f"B = {row['bits']}: Theorem 2")
        ax.errorbar(N, [p["measured"] for p in row["curve"]], yerr=[p["se"] for p in row["curve"]], fmt="o",
                    ms=3.5, color=col, mfc="none", capsize=2, label=f"B = {row['bits']}: MC mean ± SE")
        pts = [p for p in row["curve"] if p["N"] > 0]
        ax2.errorbar([p["N"] + (i - 1.5) * 0.8 for p in pts], [p["measured"] / p["formula"] - 1 for p in pts],
                     yerr=[p["se"] / p["formula"] for p in pts], fmt="o", ms=3, color=col, capsize=2)
    ax.set_yscale("log")
    ax.set_ylabel("E[F(x_N) − F*]")
    st = res["setting"]
    ax.set_title(f"Theorem 2, quadratic H = λI, d = {st['d']}, η = {st['eta']}, real quantizer (p = ∞) "
                 f"+ N(0, {st['sampling_var_per_coord']}·I) sampling noise, {st['runs']} runs", fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    ax2.axhline(0.0, color="k", lw=1)
    ax2.set_xlabel("N (steps)")
    ax2.set_ylabel("measured / formula − 1 (± SE)", fontsize=8)
    _save(fig, path, cmd)


def plot_theorem1(res: dict[str, Any], path: Path, cmd: str) -> None:
    fig = _fig(13.0, 5.2)
    ax, ax2 = fig.subplots(1, 2)
    pr = res["problem"]
    series = [("valid", "upper", "C0", "-", "upper, from x₀"),
              ("restart", "upper", "C1", "-", "upper, tightest restart n₀"),
              ("restart", "lower", "C2", "--", "lower, tightest restart n₀"),
              ("valid", "lower", "C3", "--", "lower, from x₀"),
              ("printed", "upper", "0.5", ":", "upper as printed (σ² = sup, 1/6)")]
    for kind, mk in (("fixed", "o"), ("dqsgd", "s")):
        cs = [c for c in res["configs"] if c["kind"] == kind]
        if not cs:
            continue
        x = [c["mean_bits"] for c in cs]
        name = "fixed B (QSGD)" if kind == "fixed" else "DQSGD eq. 18, equal mean bits"
        ax.errorbar(x, [c["measured"] for c in cs], yerr=[c["se"] for c in cs], fmt=mk, color="k", capsize=3,
                    ms=6, mfc="k" if kind == "fixed" else "none", label=f"measured ± SE: {name}", zorder=5)
        for which, side, col, ls, lab in series:
            y = [c["bounds"][which][side]["total"] for c in cs]
            if kind == "fixed":
                ax.plot(x, y, mk + ls, color=col, ms=4, lw=1.2, label=lab)
            else:
                ax.plot(x, y, mk, color=col, ms=7, mfc="none")
    _label(ax, "mean bits per coordinate (circles: fixed B, squares: DQSGD)", f"E[F(x_N) − F*], N = {pr['N']}",
           f"Theorem 1, logistic regression: n = {pr['n']}, d = {pr['d']}, L = {pr['L']:.3g}, "
           f"μ = {pr['mu']:.3g}, η = {pr['eta']:.3g}, K = {pr['K']}, {pr['runs']} runs", 8, 6.5)
    for i, c in enumerate(cc for cc in res["configs"] if "bounds_vs_N" in cc):
        col = f"C{i + 4}"
        ax2.plot(range(len(c["err_curve"])), c["err_curve"], color=col, lw=1.8, label=f"{c['name']}: measured mean")
        bv = c["bounds_vs_N"]
        ax2.plot(bv["N"], bv["upper"], "-.", color=col, lw=0.8, label=f"{c['name']}: upper from x₀")
        ax2.plot(bv["N"], bv["restart_upper"], "--", color=col, lw=1.2, label=f"{c['name']}: upper, tightest restart")
        ax2.plot(bv["N"], bv["restart_lower"], ":", color=col, lw=1.2, label=f"{c['name']}: lower, tightest restart")
    _label(ax2, "N (steps)", "E[F(x_N) − F*]", "mean error and Theorem 1 bounds (valid constants) at every horizon N",
           8, 6.5)
    _save(fig, path, cmd)


def plot_prop1(res: dict[str, Any], path: Path, cmd: str) -> None:
    fig = _fig(7.5, 5.0)
    ax = fig.add_subplot()
    for i, (name, pts) in enumerate(res["series"].items()):
        b = [p["bits"] + (i - 1.5) * 0.06 for p in pts]
        m = [p["ratio_mean"] for p in pts]
        lo = [p["ratio_mean"] - p["ratio_min"] for p in pts]
        hi = [p["ratio_max"] - p["ratio_mean"] for p in pts]
        ax.errorbar(b, m, yerr=[lo, hi], fmt="o-", ms=4, lw=1, capsize=2, color=f"C{i}",
                    label=f"{name} (mean, min–max over vectors)")
    ax.axhline(1.0, color="k", lw=1, label="Proposition 1: d‖g‖²/(6s²)")
    ax.axhline(1.5, color="k", lw=1, ls="--", label="worst case d‖g‖²/(4s²)")
    ax.axhline(res["assumption_expected_ratio"], color="0.5", lw=1, ls=":", label="(d − 1)/d (p = ∞, max coordinate exact)")
    _label(ax, "bits B (s = 2^(B−1) − 1)", "measured E‖Q(g) − g‖² / (d‖g‖_p²/(6s²))",
           f"Proposition 1, real quantizer, d = {res['d']}, {res['vectors_per_set']} vectors × "
           f"{res['draws_per_vector']} draws per point", 8, 6.5)
    _save(fig, path, cmd)


def plot_equal_bits(res: dict[str, Any], path: Path, cmd: str) -> None:
    fig = _fig(15.0, 4.6)
    ax, ax2, ax3 = fig.subplots(1, 3)
    rows = res["rows"]
    b = [r["budget_bits"] for r in rows]
    ax.plot(b, [r["quant_term_fixed"] for r in rows], "o-", color="C0", label="fixed B")
    ax.plot(b, [r["quant_term_dqsgd"] for r in rows], "s-", color="C3", label="DQSGD eq. 18 (integer, closed loop)")
    ax.plot(b, [r["quant_term_real_optimum"] for r in rows], "^:", color="C2",
            label="real-valued optimum (optimal_real_bits)")
    _label(ax, "mean bits per coordinate (equal total bits)",
           "Σ_n w_n E‖g_n‖²/s_n²  (Theorem 1 upper, quantization term)", "bound: quantization term", 9, 7)
    ax2.errorbar([x - 0.03 for x in b], [r["measured_fixed"] for r in rows], yerr=[r["se_fixed"] for r in rows],
                 fmt="o-", color="C0", capsize=3, label="fixed B: measured ± SE")
    ax2.errorbar([x + 0.03 for x in b], [r["measured_dqsgd"] for r in rows], yerr=[r["se_dqsgd"] for r in rows],
                 fmt="s-", color="C3", capsize=3, label="DQSGD: measured ± SE")
    _label(ax2, "mean bits per coordinate (equal total bits)", "E[F(x_N) − F*] (measured)", "measurement: final error",
           9, 7)
    for i, r in enumerate(rows):
        ax3.plot(r["dqsgd_bits_profile"], color=f"C{i}", lw=1.5, label=f"DQSGD, B̄ = {r['budget_bits']} (mean over runs)")
        ax3.plot(r["real_optimum_bits"], color=f"C{i}", lw=1, ls=":", label=f"real-valued optimum, B̄ = {r['budget_bits']}")
    _label(ax3, "step n", "bits per coordinate B_n", "widths chosen", 9, 7, log=False)
    _save(fig, path, cmd)
