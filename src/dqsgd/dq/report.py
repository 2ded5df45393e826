"""The Markdown report and the figures of a Double Quantization experiment (matplotlib, Agg canvas).

Everything is drawn from the results dict that :func:`dqsgd.dq.experiment.run_experiment` also
writes to ``results.json``: the table "bits until the training loss first falls below the
target" with × savings against the baseline (without and with the epoch-sync bits), loss vs bits
and vs (simulated) time, μ against bits, and the φ ablation.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dqsgd.core.extras import require
from dqsgd.train.runfiles import atomic_write

Figure = require("matplotlib.figure", "the dq report's figures").Figure  # the [plots] extra

__all__ = ["write_report", "bits_table"]

_TAGS = ("Tags: [text] checked against stored paper text; [recalled]/[third-party] unverified; "
         "[OC] our choice (docs/algorithms.md §0).")


def _fmt_bits(b: float | None) -> str:
    return "—" if b is None else f"{b:.3e}"


def _x(base: float | None, v: float | None) -> str:
    return "—" if not base or not v else f"{base / v:.2f}×"


def bits_table(doc: dict[str, Any], group: str = "main") -> list[dict[str, Any]]:
    """One row per run of ``group``: bits to target (inner / with sync), × vs baseline, …"""
    runs = doc["runs"]
    base = runs.get(doc["baseline"], {}).get("reached") or {}
    rows = []
    for label, r in runs.items():
        if r["group"] != group:
            continue
        got = r["reached"] or {}
        bx = {int(k): v for k, v in r["bx_hist"].items()}
        model_msgs = sum(v for k, v in bx.items() if k > 0)
        rows.append({
            "label": label, "algorithm": r["algorithm"], "reached": bool(got),
            "bits": got.get("bits"), "bits_sync": got.get("bits_with_sync"),
            "x": _x(base.get("bits"), got.get("bits")), "x_sync": _x(base.get("bits_with_sync"), got.get("bits_with_sync")),
            "updates": got.get("updates"), "epoch": got.get("epoch"), "sim_time": got.get("sim_time"),
            "final_loss": r["final_loss"], "rejected": r["rejected_stale"], "mu": r["config"]["mu"],
            "phi_div": r["config"]["phi_div"], "mean_bx": (sum(k * v for k, v in bx.items() if k > 0) / model_msgs
                                                           if model_msgs else 0.0),
            "bits_per_update": (r["bits"] / r["updates"]) if r["updates"] else None,
        })
    return rows


def _plot_curves(doc: dict[str, Any], out: Path, xkey: str, xlabel: str, name: str,
                 labels: set[str] | None = None) -> str:
    """Loss against ``xkey`` for the runs in ``labels`` (default: the main table's)."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for label, r in doc["runs"].items():
        if (r["group"] != "main" if labels is None else label not in labels) or not r["evals"]:
            continue
        xs = [e[xkey] for e in r["evals"]]
        ys = [e["loss"] if e["loss"] is not None else math.nan for e in r["evals"]]
        ax.plot(xs, ys, marker=".", ms=3, lw=1.2, label=label)
    ax.axhline(doc["target"], color="k", ls=":", lw=1, label=f"target {doc['target']:.4g}")
    if xkey.startswith("bits"):
        ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training loss F(x)")
    ax.set_title(f"{doc['name']}: loss vs {xlabel.split(' (')[0]}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    return name


def _plot_sweep(rows: list[dict[str, Any]], key: str, xlabel: str, out: Path, name: str, title: str) -> str | None:
    pts = sorted((r[key], r["bits"], r["bits_sync"]) for r in rows if r["bits"] is not None)
    if not pts:
        return None
    fig = Figure(figsize=(5.2, 3.8))
    ax = fig.subplots()
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="inner loop")
    ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", label="with epoch-sync")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("bits until target")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    return name


def _main_table(rows: list[dict[str, Any]], base: str) -> list[str]:
    lines = [f"| method | bits to target | × vs {base} | bits incl. epoch-sync | × vs {base} (incl. sync) | "
             "updates | epoch | sim time (s) | final loss | stale rejects | mean b_x | bits/update |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        st = "—" if r["sim_time"] is None else f"{r['sim_time']:.2f}"
        fl = "nan" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
        lines.append(f"| {r['label']} | {_fmt_bits(r['bits']) if r['reached'] else 'not reached'} | {r['x']} | "
                     f"{_fmt_bits(r['bits_sync'])} | {r['x_sync']} | {r['updates'] or '—'} | "
                     f"{'—' if r['epoch'] is None else r['epoch']} | {st} | {fl} | {r['rejected']} | "
                     f"{r['mean_bx']:.2f} | {_fmt_bits(r['bits_per_update'])} |")
    return lines


def _sweep_table(rows: list[dict[str, Any]], key: str, head: str) -> list[str]:
    lines = [f"| {head} | bits to target | incl. epoch-sync | updates | final loss | mean b_x | bits/update |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r[key]):
        fl = "nan" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
        lines.append(f"| {r[key]:g} | {_fmt_bits(r['bits']) if r['reached'] else 'not reached'} | "
                     f"{_fmt_bits(r['bits_sync'])} | {r['updates'] or '—'} | {fl} | {r['mean_bx']:.2f} | "
                     f"{_fmt_bits(r['bits_per_update'])} |")
    return lines


def _header(doc: dict[str, Any]) -> list[str]:
    any_run = next(iter(doc["runs"].values()))
    cfg = any_run["config"]
    p = doc["problem"]
    return [f"# {doc['name']}: Double Quantization (Yu, Wu, Huang, NeurIPS 2019) on the asynchronous engine", "",
             f"Command: `dqsgd dq run --config {doc['name']}` (source `{doc['source']}`).", "",
             f"- Problem: {p['dataset']} / {p['model']}, n = {doc['n']} training samples, d = {doc['d']}; "
             f"λ₂ = {p['l2']:g}, λ₁ = {p['l1']:g} [OC]. Data: {doc['data_note']}.",
             f"- Target: training loss first below **{doc['target']:.5g}** "
             + (f"(F* + {doc['target'] - doc['fstar']:.3g}, F* = {doc['fstar']:.5f}; {doc['fstar_how']})."
                if doc["fstar"] is not None else "(absolute target)."),
             f"- Engine: M = {cfg['workers']} workers, m = {any_run['m']} updates/epoch, batch {cfg['batch']}, "
             f"η = {cfg['lr']:g}, b = {cfg['grad_bits']}, μ = {cfg['mu']:g}, b_x,max = {cfg['bx_max']}, "
             f"φ = d/{cfg['phi_div']:g}, τ = {cfg['tau'] or 2 * cfg['workers']}, θ = "
             f"{cfg['theta'] if cfg['theta'] else '2/(s+4)'} (Acc), transport `{cfg['transport']}`; "
             f"sim delays {cfg['delay']} (mean {cfg['compute_s']:g} s), links {cfg['bandwidth_bps']:.3g} bit/s [all OC].",
             "- Bits are measured: 8·len(bytes) of every message, envelopes included; the training loss is "
             f"evaluated every {cfg['eval_every']} master updates, so 'bits to target' has that granularity.",
             f"- Wall time of the whole experiment: {doc['wall_s']:.0f} s ({doc.get('cpu_s', 0):.0f} s CPU time of the "
             "runs; the two differ when other processes share the cores).", "", _TAGS, "",
             "## Bits transmitted until the training loss first falls below the target", ""]


def _staleness(runs: dict[str, Any]) -> list[str]:
    lines = ["## Staleness and time", "",
              "Staleness t − D(t) of every arriving gradient (full histograms in results.json / the JSONL summary "
              "lines); arrivals staler than τ are recomputed from the fresh model, their bits counted. Time columns "
              "are process seconds spent in each part (sim time: the simulated clock).", "",
              "| run | arrivals | mean staleness | max | rejected > τ | compute s | encode s | master encode s | "
              "eval s | sim time s | wall s | CPU s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, r in runs.items():
        t = r["timers"]
        hist = {int(k): v for k, v in r["staleness_hist"].items()}
        n = sum(hist.values())
        mean = sum(k * v for k, v in hist.items()) / n if n else 0.0
        rej = r["rejected_stale"]
        lines.append(f"| {label} | {n} | {mean:.1f} | {max(hist, default=0)} | {rej} ({100 * rej / max(n, 1):.1f}%) | "
                     f"{t.get('compute_s', 0):.1f} | {t.get('encode_s', 0):.1f} | {t.get('master_encode_s', 0):.1f} | "
                     f"{t.get('eval_s', 0):.1f} | {r['sim_time']:.2f} | {r['wall_s']:.1f} | {t.get('cpu_s', 0):.1f} |")
    return lines


def write_report(doc: dict[str, Any], out: Path) -> Path:
    runs = doc["runs"]
    main = bits_table(doc, "main")
    by = {r["label"]: r for r in main}
    mu_rows = bits_table(doc, "mu") + ([by["asylpg"]] if "asylpg" in by else [])
    phi_rows = bits_table(doc, "phi") + ([by["sparse-asylpg"]] if "sparse-asylpg" in by else [])
    figs = [_plot_curves(doc, out, "bits", "bits transmitted (inner loop, measured)", "loss_vs_bits.png"),
            _plot_curves(doc, out, "bits_with_sync", "bits transmitted incl. epoch-sync", "loss_vs_bits_sync.png"),
            _plot_curves(doc, out, "sim_time", "time (s; simulated for the sim transport)", "loss_vs_time.png")]
    if len(mu_rows) > 1:
        figs.append(_plot_sweep(mu_rows, "mu", "μ", out, "mu_vs_bits.png", "AsyLPG: μ vs bits until target"))
        figs.append(_plot_curves(doc, out, "bits", "bits transmitted (AsyLPG, μ sweep)", "mu_curves.png",
                                 {r["label"] for r in mu_rows}))
    if len(phi_rows) > 1:
        figs.append(_plot_sweep(phi_rows, "phi_div", "d/φ", out, "phi_vs_bits.png", "Sparse-AsyLPG: φ ablation"))
    lines = _header(doc) + [
        *_main_table(main, doc["baseline"]), "",
        "'bits to target' counts the inner loop (gradients up, models down); 'incl. epoch-sync' adds the "
        "fp32 snapshot / full-gradient traffic of the SVRG epochs. mean b_x: mean width of the quantized "
        "model messages (32 = fp32; the 1-byte snapshot flags are left out).", ""]
    if len(mu_rows) > 1:
        lines += ["## μ vs bits (AsyLPG)", "", *_sweep_table(mu_rows, "mu", "μ"), ""]
    if len(phi_rows) > 1:
        lines += ["## φ ablation (Sparse-AsyLPG, φ = d/phi_div)", "", *_sweep_table(phi_rows, "phi_div", "d/φ"), ""]
    lines += _staleness(runs)
    lines += ["", "## Figures", ""] + [f"![{f}]({f})" for f in figs if f] + [""]
    path = out / "report.md"
    atomic_write(path, "\n".join(lines))  # never through a link planted in the output directory
    return path
