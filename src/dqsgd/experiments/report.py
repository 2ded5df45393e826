"""``ROOT/report.md`` (with fig1.png, fig2.png, fig3.png, fig4.png) from the run directories' JSONL files alone.

The report is a pure function of ``experiment.toml``, every ``config.json`` and ``metrics.jsonl`` under
the root: no clock, no logs, so ``dqsgd report ROOT`` rebuilds the same text after the fact. It states
what was run (and how to run it again), the Table 1-style results with both compression-ratio
definitions, the paper's own Table 1 for reference, the figures, each method's description with its
[OC] / [text] tags, and a reading of the numbers that claims nothing they do not show.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from dqsgd.experiments.plot_bytes import caption as figure4_caption, figure4
from dqsgd.experiments.plots import Run, figure1, figure2, figure3, load_runs, methods_of, notes
from dqsgd.experiments.provenance import provenance
from dqsgd.experiments.reproduce import reproduce_commands
from dqsgd.experiments.stats import paired_interval
from dqsgd.experiments.summary import aggregate, ratio_or_dash, write_tables
from dqsgd.method.config import METHODS
from dqsgd.train.runfiles import atomic_write
from dqsgd.topology.registry import SIMULATED_DEFAULT, topology_of

CLOSE_PT = 0.5  # "within 0.5 pt of SGD" in the reading of the results

RATIO_DEFINITIONS = (
    "**uplink ratio, fixed-width (paper's convention)** = fp32 uplink bytes (4·d·W·steps) / uplink bytes really sent "
    "(payload lengths: headers, norms, scalers and the method's coding included: fixed-width unless the method "
    "sets another coding); **total-traffic ratio** = the same over every message, "
    "uplink and downlink (fp32 reference: 4·d per message; the all-gather topology has no downlink); **paper ratio** = 32 / mean nominal bits per coordinate "
    "(the convention of DQSGD Table 1, which ignores headers, norms and the downlink).")


def coded_definition(runs: list[Run]) -> str:
    """The legend's sentence on the entropy-coded column, with the runs' ``train.coded_every``."""
    every = sorted({int(r.facts["train_config"].get("coded_every", 1)) for r in runs if r.summary.get("coded_steps")})
    when = ("on every step" if every == [1] else
            "on every k-th step only (steps n with n % k == 0, `train.coded_every` = k = "
            + ", ".join(str(k) for k in every) + ")" if every else "on the steps of `train.coded_every`")
    return ("**uplink ratio, entropy-coded (auto)** = the same fp32 uplink bytes / the bytes the same payloads take "
            "when their levels are really re-encoded with the best coding (`auto`: the smallest of fixed-width, "
            f"Elias-ω, zstd-aligned and rANS; fp32 payloads count as sent), measured {when} and over those steps; "
            "the levels, hence the accuracy, are the same; — = not measured (a run without coded sizes).")

# DQSGD (ICLR 2021 submission) Table 1, copied from the paper: (method, then accuracy and compression
# ratio for AG-News (BiLSTM), CIFAR-10 (ResNet-18), CIFAR-100 (ResNet-34)), W = 8 workers.
PAPER_TABLE1: tuple[tuple[str, ...], ...] = (
    ("Vanilla SGD", "0.9016", "1", "0.8815", "1", "0.6969", "1"),
    ("SignSGD", "0.8663", "32", "0.5191", "32", "0.3955", "32"),
    ("TernGrad", "0.8480", "16", "0.7418", "16", "0.6174", "16"),
    ("QSGD (4 bits)", "0.8894", "8", "0.8545", "8", "0.6837", "8"),
    ("QSGD (6 bits)", "0.9006", "5.33", "0.8803", "5.33", "0.6969", "5.33"),
    ("Adaptive", "0.8991", "6.53", "0.8787", "5.52", "0.6943", "5.93"),
    ("AdaQS", "0.9001", "6.53", "0.8809", "5.35", "0.6960", "5.11"),
    ("DQSGD (Ours)", "0.8997", "6.81", "0.8793", "7.11", "0.6959", "6.73"),
)

FIGURES = (
    ("fig1.png", figure1, "Figure 1 (as the paper's Figure 1): (a) test accuracy, (b) training loss (trailing "
     "mean), (c) nominal bits per iteration, (d) cumulative measured uplink MB; mean over seeds, band = ± std."),
    ("fig2.png", figure2, "Figure 2 (as the paper's Figure 2): test accuracy (mean ± std over seeds) vs (a) the "
     "measured fixed-width uplink ratio and (b) the entropy-coded (auto) uplink ratio (log scale); a line joins "
     "only the methods of one family (the same method at other widths or budgets, e.g. the QSGD widths)."),
    ("fig3.png", figure3, "Widths chosen by the methods whose width varies, and time per run by phase."),
    ("fig4.png", figure4, figure4_caption()),
)


FIGURES_MISSING = ("figures not drawn: they need the optional package 'matplotlib' (pip install 'dqsgd[plots]'); "
                   "the runs, tables and report.md do not. Draw them later with `dqsgd report RUN_DIR`.")


def figures_available() -> bool:
    """Whether matplotlib can be imported (the [plots] extra): the figures are drawn only then."""
    from dqsgd.core.extras import available

    return available("matplotlib")


def build_report(root: Path) -> Path:
    """Write ``root/report.md`` and its figures (and the tables if ``summary.json`` is missing or stale);
    without matplotlib, the report without figures (it says how to get them)."""
    root = Path(root)
    runs = load_runs(root)
    if not runs:
        raise FileNotFoundError(f"{root}: no runs (no */seed*/metrics.jsonl with config.json)")
    summary = root / "summary.json"
    newest = max((r.path / "metrics.jsonl").stat().st_mtime for r in runs)
    if not summary.exists() or summary.stat().st_mtime < newest:
        write_tables(root)
    figures = figures_available()
    for name, draw, _ in FIGURES if figures else ():
        draw(runs, root / name)
    out = root / "report.md"
    atomic_write(out, render_report(root, runs, figures))  # never through a link planted in the output directory
    return out


def render_report(root: Path, runs: list[Run], figures: bool = True) -> str:
    """The Markdown text of the report (a pure function of the runs; ``figures``: whether they were drawn)."""
    labels = methods_of(runs)
    rows = aggregate([r.summary for r in runs], order=labels)
    train = runs[0].facts["train_config"]
    parts = [
        f"# {train['name']}: accuracy vs communication (DQSGD Table 1, Figures 1–2)",
        _setup(runs),
        provenance(runs),
        "## Reproduce\n\n```sh\n" + "\n".join(reproduce_commands(root, runs)) + "\n```",
        "## Results (Table 1 style)\n\n" + results_table(rows, runs) + "\n\n" + RATIO_DEFINITIONS + " "
        + coded_definition(runs)
        + ("\n\n**Left out or incomplete:**\n\n" + "\n".join(f"- {n}" for n in notes(runs)) if notes(runs) else ""),
        paper_table(),
        "## Figures\n\n" + ("\n\n".join(f"![{name}]({name})\n\n*{cap}*" for name, _, cap in FIGURES) if figures
                              else FIGURES_MISSING[0].upper() + FIGURES_MISSING[1:]),
        methods_section(runs, labels),
        "## Reading the results\n\n" + reading(rows, runs),
        intervals_section(rows, runs),
    ]
    return "\n\n".join(parts) + "\n"


def _dataset_name(key: str) -> str:
    from dqsgd.data import DATASETS

    return DATASETS.get(key, key).split(",")[0].removesuffix(" digits")


def _setup(runs: list[Run]) -> str:
    f = runs[0].facts
    t = f["train_config"]
    seeds = sorted({r.seed for r in runs})
    lines = [f"**Setup.** dataset {_dataset_name(f['dataset'])} (`{f['dataset']}`), model `{t['model']}` "
             f"(d = {f['numel']:,} parameters), W = {f['workers']} workers, {t['steps']} steps, batch {t['batch_size']} "
             f"per worker, lr {t['lr']} ({t['lr_schedule']}), momentum {t['momentum']}, test evaluation every "
             f"{t['eval_every']} steps and at the end; seeds {seeds} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''}), "
             f"{len(runs)} runs."]
    if f.get("stand_in_for"):
        lines.append(f"**{_dataset_name(f['dataset'])} stands in for {f['stand_in_for']} (not obtainable offline): "
                     f"these are not {f['stand_in_for']} results.**")
    short = [f"{r.method}/seed{r.seed} ({r.step.size} of {t['steps']})" for r in runs if r.step.size < t["steps"]]
    if short:
        lines.append("Runs with fewer steps recorded than configured (still running or stopped): " + ", ".join(short) + ".")
    if any(r.facts["train_config"] != t for r in runs):
        lines.append("**Not every run has the same [train] settings** (see each run's config.json).")
    return "\n\n".join(lines)


# --- tables ----------------------------------------------------------------------------------------
def _pm(m: float, s: float, n: int, sign: bool = False) -> str:
    """``mean ± std`` in points (×100); the mean alone when there is only one value (no std to show)."""
    if m is None or math.isnan(m):
        return "n/a"
    mean = f"{100 * m:{'+' if sign else ''}.2f}"
    return mean if n < 2 else f"{mean} ± {100 * s:.2f}"


def _num(x: float, fmt: str = ".2f") -> str:
    return "n/a" if x is None or math.isnan(x) else ("∞" if math.isinf(x) else f"{x:{fmt}}")


def results_table(rows: list[dict[str, Any]], runs: list[Run]) -> str:
    head = ["method", "seeds", "test acc (%)", "Δ vs SGD (pt, paired)", "uplink ratio, fixed-width (paper's convention)",
            "uplink ratio, entropy-coded (auto)", "total-traffic ratio", "paper ratio", "mean bits", "MB up", "MB down"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        n_eval = sum(1 for x in runs if x.method == r["method"] and x.has_eval)
        seeds = str(r["seeds"]) + (f" ({n_eval} evaluated)" if n_eval < r["seeds"] else "")
        n_pair = len(_paired(runs, r["method"], "sgd"))
        delta = "baseline" if r["method"] == "sgd" else _pm(r["delta_vs_sgd_mean"], r["delta_vs_sgd_std"], n_pair, sign=True)
        cells = [f"`{r['method']}`", seeds, _pm(r["test_acc_mean"], r["test_acc_std"], n_eval), delta, _num(r["measured_ratio"]),
                 ratio_or_dash(r.get("coded_ratio")), _num(r.get("total_ratio", float("nan"))), _num(r["paper_ratio"]), _num(r["mean_bits"]),
                 _num(r["up_bytes"] / 1e6), _num(r.get("down_bytes", float("nan")) / 1e6)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + ("\n\nMean ± std over the evaluated seeds (the mean alone for one seed); Δ = this "
                              "method's test accuracy minus SGD's on the same seed, in points.")


def paper_table() -> str:
    head = "| method (paper) | AG-News acc | AG-News ratio | CIFAR-10 acc | CIFAR-10 ratio | CIFAR-100 acc | CIFAR-100 ratio |"
    rows = [head, "|---" + "|---:" * 6 + "|"] + ["| " + " | ".join(r) + " |" for r in PAPER_TABLE1]
    return ("## The paper's Table 1 (the paper's numbers, not ours)\n\n"
            "Copied from DQSGD (ICLR 2021 submission), Table 1: BiLSTM on AG-News, ResNet-18 on CIFAR-10, "
            "ResNet-34 on CIFAR-100, W = 8; top-1 accuracy as a fraction and the paper ratio (32 / bits).\n\n"
            + "\n".join(rows))


# --- methods and reading ---------------------------------------------------------------------------
def _config_line(facts: dict[str, Any]) -> str:
    c = facts["method_config"]
    width = {"identity": 32, "sign": 1, "ternary": 2}.get(c["scheme"], c["bits"])
    bits = (f"{width} bit{'s' if width > 1 else ''}" if c["policy"] == "fixed" else
            f"policy {c['policy']}, B₀ = {c['bits']}, widths in [{c['min_bits']}, {c['max_bits']}]"
            + (f", target {c['target_bits']} bits/coordinate" if c.get("target_bits") else "")
            + (f", budget {c['budget_bits']:,} bits/worker" if c.get("budget_bits") else ""))
    extra = [f"coding {c['coding']}"] if c["coding"] != "fixed" else []
    extra += ["error feedback"] if c["error_feedback"] else []
    extra += [f"aggregate {c['aggregate']}"] if c["aggregate"] != "mean" else []
    if facts.get("lr") is not None and facts["lr"] != facts["train_config"]["lr"]:
        extra.append(f"lr {facts['lr']}")
    return ", ".join([f"scheme {c['scheme']}", bits] + extra + _legs(facts))


def _legs(facts: dict[str, Any]) -> list[str]:
    """The topology when it is not the simulation's ``ps``, and on ``sharded`` the downlink as configured:
    a fixed width, or ``"auto"`` with the both-leg budget the run's ledger charged (``budget_bits``, per
    worker over the run), per coordinate and step, so that two rows that differ only there read apart."""
    t = facts["train_config"]
    topology = topology_of(t.get("topology") or SIMULATED_DEFAULT)
    if topology is topology_of(SIMULATED_DEFAULT):
        return []
    out = [f"topology {topology}"]
    if not topology.sharded:
        return out
    down = t.get("downlink_bits", 0)
    if down == "auto":
        budget = facts.get("budget_bits")
        per = f": {budget / (facts['numel'] * t['steps']):.2f} bits/coordinate/step" if budget else ""
        out.append(f"downlink auto (one budget for both legs{per})")
    else:
        out.append({0: "downlink the method's default", 32: "downlink fp32"}.get(down, f"downlink {down} bits"))
    return out + (["downlink error feedback"] if t.get("downlink_feedback") else [])


def methods_section(runs: list[Run], labels: list[str]) -> str:
    lines = ["## Methods", "",
             "Descriptions from `dqsgd.method.config.METHODS`, tags kept: [OC] (or [OC rule]) = our choice where the "
             "cited paper leaves it open; [text] = as the paper's text states it.", ""]
    for m in labels:
        facts = next(r.facts for r in runs if r.method == m)
        c = facts["method_config"]
        desc = METHODS.get(c["name"]) or METHODS.get(m) or c.get("description") or "(no description)"
        lines.append(f"- `{m}`: {desc}. *Run with:* {_config_line(facts)}.")
    return "\n".join(lines)


def _paired(runs: list[Run], a: str, b: str) -> list[float]:
    acc = {(r.method, r.seed): r.summary["test_acc"] for r in runs}
    return [acc[(a, s)] - acc[(b, s)] for (m, s) in acc if m == a and (b, s) in acc
            and not math.isnan(acc[(a, s)]) and not math.isnan(acc[(b, s)])]


def reading(rows: list[dict[str, Any]], runs: list[Run]) -> str:
    f, t = runs[0].facts, runs[0].facts["train_config"]
    out = [f"The paper trains ResNet-18/34 and a BiLSTM on CIFAR-10/100 and AG-News; these are {t['steps']}-step runs "
           f"of `{t['model']}` on {_dataset_name(f['dataset'])}, so compare the pattern (who stays close to SGD, at "
           "what compression), not the absolute accuracies."]
    by = {r["method"]: r for r in rows}
    others = [r for r in rows if r["method"] != "sgd" and not math.isnan(r["delta_vs_sgd_mean"])]
    if "sgd" not in by:
        out.append("There is no `sgd` run, so there are no paired differences to SGD.")
    elif others:
        d = {r["method"]: 100 * r["delta_vs_sgd_mean"] for r in others}
        close = [f"`{m}` ({v:+.2f})" for m, v in d.items() if abs(round(v, 2)) <= CLOSE_PT]  # as printed
        far = [f"`{m}` ({v:+.2f})" for m, v in d.items() if abs(round(v, 2)) > CLOSE_PT]
        out.append(f"Within {CLOSE_PT} pt of SGD (mean paired Δ, pt): {', '.join(close) or 'none'}. "
                   f"Further than {CLOSE_PT} pt: {', '.join(far) or 'none'}.")
    out += _seed_noise(rows, runs, others)
    out += _matched_ratio(rows, runs)
    out += _dq_vs_q(rows, runs)
    off = [f"`{r['method']}` ({r['measured_ratio']:.2f} vs {r['paper_ratio']:.2f})" for r in rows
           if math.isfinite(r["measured_ratio"]) and math.isfinite(r["paper_ratio"])
           and abs(r["measured_ratio"] / r["paper_ratio"] - 1) > 0.05]
    out.append("Measured and paper ratios agree within 5% for every method." if not off else
               "Measured ratio differs from the paper ratio by more than 5% for: " + ", ".join(off)
               + " (the measured one counts headers, norms, scalers and coding; the paper one only nominal bits).")
    return "\n\n".join(out)


def _seed_noise(rows: list[dict[str, Any]], runs: list[Run], others: list[dict[str, Any]]) -> list[str]:
    """Is the seed-to-seed spread larger than the differences to SGD?"""
    n_eval = {r["method"]: sum(1 for x in runs if x.method == r["method"] and x.has_eval) for r in rows}
    stds = [100 * r["test_acc_std"] for r in rows if n_eval[r["method"]] > 1]
    if not stds:
        return ["With one seed per method there is no estimate of seed-to-seed variation: each Δ is a single "
                "paired difference, and small gaps may be noise (add seeds with `--set 'train.seeds=[0,1,2]'`)."]
    sgd = [r for r in rows if r["method"] == "sgd"]
    out = [f"Seed-to-seed std of test accuracy: median {statistics.median(stds):.2f} pt over methods"
           + (f" (SGD {100 * sgd[0]['test_acc_std']:.2f} pt)" if sgd else "") + "."]
    if not sgd:
        return out
    pairs = {r["method"]: len(_paired(runs, r["method"], "sgd")) for r in others}
    few = [f"`{r['method']}`" for r in others if pairs[r["method"]] < 2]
    many = [r for r in others if pairs[r["method"]] >= 2]
    within = [f"`{r['method']}`" for r in many if abs(r["delta_vs_sgd_mean"]) <= r["delta_vs_sgd_std"]]
    beyond = [f"`{r['method']}`" for r in many if abs(r["delta_vs_sgd_mean"]) > r["delta_vs_sgd_std"]]
    out.append(f"The mean paired Δ is no larger than its seed-to-seed std (these seeds do not separate the method "
               f"from SGD) for: {', '.join(within) or 'none'}; larger for: {', '.join(beyond) or 'none'} (a rough "
               "criterion with few seeds, not a significance test)"
               + (f"; fewer than two paired seeds: {', '.join(few)}." if few else "."))
    return out


def matched_ratio_deltas(rows: list[dict[str, Any]], runs: list[Run],
                         key: str = "measured_ratio") -> dict[str, dict[str, Any]]:
    """Figure 2 read at each DQSGD run's ratio ``key`` (the fixed-width uplink ratio, or
    ``coded_ratio``: the entropy-coded one, panel b): DQSGD's accuracy minus QSGD's curve there.

    QSGD's curve joins its fixed widths, accuracy linear in log(ratio) (as Figure 2 draws it on a log
    axis); it is interpolated seed by seed, so each difference is paired (same data, same seed).
    DQSGD methods outside the QSGD ratios' range get ``{"outside": True}``.
    """
    def has(r: dict[str, Any]) -> bool:
        return r.get(key) is not None and math.isfinite(r[key])

    q = sorted((r for r in rows if r["method"].startswith("qsgd") and has(r)), key=lambda r: r[key])
    acc = {(r.method, r.seed): r.summary["test_acc"] for r in runs if r.has_eval}
    out: dict[str, dict[str, Any]] = {}
    if len(q) < 2:
        return out
    for dq in (r for r in rows if r["method"].startswith("dqsgd") and has(r)):
        x = dq[key]
        pair = next(((lo, hi) for lo, hi in zip(q, q[1:]) if lo[key] <= x <= hi[key]), None)
        if pair is None:
            out[dq["method"]] = {"outside": True, "ratio": x}
            continue
        lo, hi = pair
        span = math.log(hi[key]) - math.log(lo[key])
        f = (math.log(x) - math.log(lo[key])) / span if span > 0 else 0.0
        seeds = sorted(s for (m, s) in acc if m == dq["method"])
        d = [acc[(dq["method"], s)] - ((1 - f) * acc[(lo["method"], s)] + f * acc[(hi["method"], s)]) for s in seeds
             if (lo["method"], s) in acc and (hi["method"], s) in acc]
        d = [v for v in d if not math.isnan(v)]
        out[dq["method"]] = {"outside": False, "ratio": x, "lo": lo["method"], "hi": hi["method"], "deltas": d}
    return out


def _matched_ratio(rows: list[dict[str, Any]], runs: list[Run]) -> list[str]:
    return _matched_lines(rows, runs, "measured_ratio", "At matched ratio (Figure 2)") + _matched_lines(
        rows, runs, "coded_ratio", "At matched entropy-coded ratio (Figure 2b, QSGD's levels coded with `auto`)")


def _matched_lines(rows: list[dict[str, Any]], runs: list[Run], key: str, title: str) -> list[str]:
    lines = []
    for m, r in matched_ratio_deltas(rows, runs, key).items():
        if r["outside"]:
            lines.append(f"{title}: `{m}` (ratio {r['ratio']:.2f}) lies outside the QSGD widths' ratios: no "
                         "matched-ratio comparison.")
            continue
        d = [100 * v for v in r["deltas"]]
        if not d:
            continue
        sd = f" ± {statistics.stdev(d):.2f}" if len(d) > 1 else ""
        verdict = ("at or above QSGD's curve" if statistics.fmean(d) >= 0 else "below QSGD's curve") + (
            " (within the seed-to-seed std)" if len(d) > 1 and abs(statistics.fmean(d)) <= statistics.stdev(d) else "")
        lines.append(f"{title}: `{m}` at {r['ratio']:.2f}, against QSGD's curve between `{r['lo']}` "
                     f"and `{r['hi']}` (linear in log ratio, seed by seed): {statistics.fmean(d):+.2f}{sd} pt over "
                     f"{len(d)} seed{'s' if len(d) > 1 else ''}, {verdict}.")
    return lines


def intervals_section(rows: list[dict[str, Any]], runs: list[Run]) -> str:
    """Every paired difference with its 95% t interval over seeds (:mod:`dqsgd.experiments.stats`):
    to SGD for every method, and for DQSGD methods to QSGD's curve at the matched fixed-width and
    entropy-coded ratios; then, in words, which differences are significant."""
    matched = {k: matched_ratio_deltas(rows, runs, k) for k in ("measured_ratio", "coded_ratio")}
    head = ["method", "seeds", "Δ vs SGD, pt [95% CI]", "Δ vs QSGD at matched ratio, fixed-width, pt [95% CI]",
            "Δ vs QSGD at matched ratio, entropy-coded, pt [95% CI]"]
    lines = ["## Paired differences with 95% intervals", "",
             "Differences in test accuracy, method minus reference on the same seed (same initial model and "
             "minibatches), in points: mean and Student-t 95% interval over seeds. **Bold**: the interval excludes "
             "0 (significant at the 5% level). QSGD's curve is interpolated between its widths, linear in log ratio, "
             "seed by seed; — = no such comparison (not a DQSGD method, or outside QSGD's ratios).", "",
             "| " + " | ".join(head) + " |", "|---|---:|---:|---:|---:|"]
    sig: dict[str, list[str]] = {"better": [], "worse": [], "none": [], "one": []}

    def cell(label: str, what: str, diffs: list[float]) -> str:
        iv = paired_interval(diffs)
        if iv.n == 0:
            return "—"
        if iv.significant:
            sig["better" if iv.mean > 0 else "worse"].append(f"`{label}` {what} ({iv.fmt()})")
        else:
            sig["none" if iv.n >= 2 else "one"].append(f"`{label}` {what}")
        return f"**{iv.fmt()}**" if iv.significant else iv.fmt()

    for r in rows:
        m = r["method"]
        if m == "sgd":
            continue
        to_sgd = cell(m, "vs SGD", _paired(runs, m, "sgd")) if any(x.method == "sgd" for x in runs) else "—"
        cols = []
        for key, what in (("measured_ratio", "vs QSGD (fixed-width)"), ("coded_ratio", "vs QSGD (entropy-coded)")):
            got = matched[key].get(m)
            cols.append("—" if got is None or got["outside"] else cell(m, what, got["deltas"]))
        n = sum(1 for x in runs if x.method == m and x.has_eval)
        lines.append(f"| `{m}` | {n} | {to_sgd} | " + " | ".join(cols) + " |")
    return "\n".join(lines + ["", in_words(sig)])


def in_words(sig: dict[str, list[str]]) -> str:
    """The verdicts of :func:`intervals_section` in a sentence: significant either way, not
    distinguishable (two or more seeds), and what one seed cannot tell (no interval from one seed)."""
    words = []
    if sig["better"] or sig["worse"] or sig["none"]:
        words.append("significantly **more accurate** than the reference: " + ("; ".join(sig["better"]) or "none")
                     + ". Significantly **less accurate**: " + ("; ".join(sig["worse"]) or "none")
                     + ". Not distinguishable from the reference with these seeds: " + (", ".join(sig["none"]) or "none")
                     + ".")
    if sig["one"]:
        words.append("one seed cannot tell whether these differ from the reference (a difference of one seed "
                      "has no interval; run two or more, `--set 'train.seeds=[0,1,2]'`): " + ", ".join(sig["one"]) + ".")
    if not words:
        return "In words: no paired comparison (no reference run with these seeds)."
    return "In words: " + " ".join(w[0].upper() + w[1:] if i else w for i, w in enumerate(words))


def _dq_vs_q(rows: list[dict[str, Any]], runs: list[Run]) -> list[str]:
    """DQSGD against its neighbours in ratio among the fixed-width QSGDs (the nearest with fewer and with
    more bytes): uplink bytes saved and paired accuracy difference."""
    out = []
    qs = [r for r in rows if r["method"].startswith("qsgd") and r["up_bytes"]]
    for dq in (r for r in rows if r["method"].startswith("dqsgd")):
        more = [q for q in qs if q["up_bytes"] >= dq["up_bytes"]]
        fewer = [q for q in qs if q["up_bytes"] < dq["up_bytes"]]
        near = ([min(fewer, key=lambda q: dq["up_bytes"] - q["up_bytes"])] if fewer else []) + (
            [min(more, key=lambda q: q["up_bytes"] - dq["up_bytes"])] if more else [])
        for q in near:
            save = 100 * (1 - dq["up_bytes"] / q["up_bytes"])
            diff = _paired(runs, dq["method"], q["method"])
            acc = (f"test accuracy {100 * statistics.fmean(diff):+.2f} pt (paired over {len(diff)} seed"
                   f"{'s' if len(diff) > 1 else ''})" if diff else "no paired accuracy")
            how = ("the same uplink bytes as" if abs(save) < 0.05 else
                   f"{abs(save):.1f}% {'fewer' if save > 0 else 'more'} uplink bytes than")
            out.append(f"`{dq['method']}` sent {how} `{q['method']}` (measured ratio {dq['measured_ratio']:.2f} vs "
                       f"{q['measured_ratio']:.2f}), {acc}.")
    return out
