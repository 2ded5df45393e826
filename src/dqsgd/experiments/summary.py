"""Tables from the JSONL files alone: per-run facts, per-method mean ± std over seeds.

A run directory holds ``config.json`` (static facts) and ``metrics.jsonl`` (one line per step).
Everything printed or plotted is computed here from those two files — never from logs — so
``dqsgd report RUN_DIR`` rebuilds the same tables after the fact.

Compression ratios, labelled everywhere:
``measured ratio`` (uplink ratio, the paper's convention: the uplink alone) = fp32 uplink bytes
(4·d·W·steps) / uplink bytes really sent (+ side traffic);
``total ratio`` (total-traffic ratio) = fp32 bytes of every message, uplink and downlink (the
all-gather topology has no downlink) / bytes of every message really sent (+ side traffic);
``paper ratio`` = 32 / mean nominal bits per coordinate (DQSGD Table 1's convention);
``coded ratio`` (uplink ratio, entropy-coded) = fp32 uplink bytes of the steps whose line carries
``coded_up_bytes`` (``train.coded_every``) / those steps' uplink had every payload been coded with
``Coding.AUTO`` (+ side traffic, as in the measured ratio).
Runs written before the topology and the per-rank bytes were recorded read as ``ps`` with no
per-rank figures; runs without coded sizes have no coded ratio (NaN; "—" in the tables, an empty
cell in ``summary.csv``).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
import tomllib
from pathlib import Path
from typing import Any

from dqsgd.topology.registry import SIMULATED_DEFAULT, topology_of
from dqsgd.train import reader
from dqsgd.train.config import METHOD_TRAIN_KEYS
from dqsgd.train.rundir import differing, explain, resolved_of_facts

COLUMNS = ["method", "dataset", "stand_in_for", "model", "workers", "steps", "seeds", "test_acc_mean", "test_acc_std",
           "delta_vs_sgd_mean", "delta_vs_sgd_std", "measured_ratio", "coded_ratio", "total_ratio", "paper_ratio", "mean_bits", "up_bytes", "down_bytes", "rank_bytes",
           "topology", "wall_s"]


def run_dirs(root: Path) -> list[Path]:
    """The run directories under ``root`` (:func:`dqsgd.train.reader.run_dirs`: none in progress)."""
    return reader.run_dirs(root)


def method_order(root: Path) -> list[str]:
    """Labels of ``[methods.*]`` in ``root/experiment.toml``, in the order the user wrote them ([] if absent)."""
    path = root / "experiment.toml"
    if not path.is_file():
        return []
    return list(tomllib.loads(path.read_text()).get("methods", {}))  # tomllib keeps the file's order


def missing_runs(root: Path, runs: list[dict[str, Any]]) -> list[str]:
    """``LABEL/seedK`` of every run ``root/experiment.toml`` asks for that has no run directory."""
    path = root / "experiment.toml"
    if not path.is_file():
        return []
    seeds = tomllib.loads(path.read_text()).get("train", {}).get("seeds", [0])
    have = {(r["method"], r["seed"]) for r in runs}
    return [f"{m}/seed{s}" for s in seeds for m in method_order(root) if (m, s) not in have]


def ordered_labels(labels: list[str], order: list[str] | None) -> list[str]:
    """``order`` first (those present), then the remaining labels in first-seen order."""
    seen = list(dict.fromkeys(labels))
    first = [m for m in (order or []) if m in seen]
    return first + [m for m in seen if m not in first]


def summarize_run(run: Path) -> dict[str, Any]:
    facts, recs = reader.read_run(run)  # every number checked: file, line and field of a bad one
    steps = [r for r in recs if not r.get("skipped")]
    evals = [r for r in recs if r.get("test_acc") is not None]
    up = sum(int(r["up_bytes"]) for r in steps)
    side = sum(int(r.get("side_bytes", 0)) for r in steps) * facts["workers"]
    fp32 = 4 * facts["numel"] * facts["workers"] * len(steps)
    topology = facts["train_config"].get("topology") or SIMULATED_DEFAULT
    down = sum(int(r["down_bytes"]) for r in steps)
    sent = up + down + side
    fp32_all = fp32 * topology_of(topology).fp32_legs()
    ranked = [r["rank_total_bytes"] for r in steps if r.get("rank_total_bytes") is not None]
    mean_bits = statistics.fmean(r["bits"] for r in steps) if steps else float("nan")
    tail = [r["loss"] for r in steps[-20:] if r.get("loss") is not None]
    coded = [r for r in steps if r.get("coded_up_bytes") is not None]
    coded_up = sum(int(r["coded_up_bytes"]) for r in coded)
    coded_sent = coded_up + sum(int(r.get("side_bytes", 0)) for r in coded) * facts["workers"] // 2
    coded_fp32 = 4 * facts["numel"] * facts["workers"] * len(coded)
    return {
        "method": facts["method"], "dataset": facts["dataset"], "stand_in_for": facts.get("stand_in_for"),
        "model": facts["train_config"]["model"], "workers": facts["workers"], "seed": facts["seed"],
        "steps": len(recs), "test_acc": evals[-1]["test_acc"] if evals else float("nan"),
        "train_loss": statistics.fmean(tail) if tail else float("nan"),
        "up_bytes": up, "down_bytes": down, "side_bytes": side, "topology": topology,
        "measured_ratio": fp32 / (up + side // 2) if up else (float("inf") if steps else float("nan")),
        "coded_ratio": (coded_fp32 / coded_sent if coded_sent else float("inf")) if coded else float("nan"),
        "coded_steps": len(coded), "coded_up_bytes": coded_up,
        "total_ratio": fp32_all / sent if sent else (float("inf") if steps else float("nan")),
        "rank_bytes": statistics.fmean(ranked) if ranked else float("nan"),  # busiest rank, per step
        "paper_ratio": 32.0 / mean_bits if mean_bits else float("inf"), "mean_bits": mean_bits,
        "wall_s": sum(r["compute_s"] + r["encode_s"] + r["decode_s"] for r in recs),
        "budget_bits": facts.get("budget_bits"),
    }


def _mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def aggregate(runs: list[dict[str, Any]], baseline: str = "sgd", order: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per method: mean ± std over seeds and the paired difference to ``baseline``.

    Rows follow ``order`` (the config's ``[methods.*]`` order), then any other method in first-seen order.
    """
    order = ordered_labels([r["method"] for r in runs], order)
    base = {r["seed"]: r["test_acc"] for r in runs if r["method"] == baseline}
    rows = []
    for m in order:
        rs = [r for r in runs if r["method"] == m]
        acc_m, acc_s = _mean_std([r["test_acc"] for r in rs])
        d_m, d_s = _mean_std([r["test_acc"] - base[r["seed"]] for r in rs if r["seed"] in base])
        rows.append({
            "method": m, "dataset": rs[0]["dataset"], "stand_in_for": rs[0]["stand_in_for"], "model": rs[0]["model"],
            "workers": rs[0]["workers"], "steps": rs[0]["steps"], "seeds": len(rs),
            "test_acc_mean": acc_m, "test_acc_std": acc_s, "delta_vs_sgd_mean": d_m, "delta_vs_sgd_std": d_s,
            "measured_ratio": _mean_std([r["measured_ratio"] for r in rs])[0],  # runs with no steps yet: NaN, left out
            "coded_ratio": _mean_std([r.get("coded_ratio", float("nan")) for r in rs])[0],  # runs without: left out
            "total_ratio": _mean_std([r["total_ratio"] for r in rs])[0],
            "paper_ratio": _mean_std([r["paper_ratio"] for r in rs])[0],
            "down_bytes": int(statistics.fmean(r["down_bytes"] for r in rs)),
            "rank_bytes": _mean_std([r["rank_bytes"] for r in rs])[0], "topology": rs[0]["topology"],
            "mean_bits": _mean_std([r["mean_bits"] for r in rs])[0],
            "up_bytes": int(statistics.fmean(r["up_bytes"] for r in rs)),
            "wall_s": statistics.fmean(r["wall_s"] for r in rs),
        })
    return rows


def check_comparable(dirs: list[Path]) -> None:
    """Refuse to put runs into one table unless they share every train key and the data, and runs of
    one method share everything but the seed (a quick ``train`` into a compare tree, a changed config).
    The Local SGD keys a method may set for itself (``METHOD_TRAIN_KEYS``) may differ between methods."""
    facts = {d: resolved_of_facts(reader.read_facts(d)) for d in dirs}
    first: dict[str, Path] = {}
    own = tuple(f"train.{k}" for k in METHOD_TRAIN_KEYS)
    for d, res in facts.items():
        shared = tuple(k for k in res if not (k.startswith("train.") or k == "data")) + own
        for ref, ignore in ((dirs[0], shared), (first.setdefault(str(res.get("method")), d), ("seed",))):
            keys = differing(res, facts[ref], ignore)
            if keys:
                raise ValueError(f"runs {ref} and {d} differ in {explain(keys, res, facts[ref])}: they do not belong in "
                                 f"one table; report them separately (move one out of this directory)")


def write_tables(root: Path) -> list[dict[str, Any]]:
    check_comparable(run_dirs(root))
    runs = [summarize_run(d) for d in run_dirs(root)]
    if not runs:
        raise FileNotFoundError(f"{root}: no runs (no */seed*/metrics.jsonl with config.json)")
    order = ordered_labels([r["method"] for r in runs], method_order(root))
    runs.sort(key=lambda r: (order.index(r["method"]), r["seed"]))
    rows = aggregate(runs, order=order)
    missing = missing_runs(root, runs)
    if missing:
        print(f"dqsgd: warning: {root}: run(s) {', '.join(missing)} of experiment.toml missing (no config.json with "
              f"metrics.jsonl): left out of the tables", file=sys.stderr, flush=True)
    (root / "summary.json").write_text(json.dumps({"runs": runs, "methods": rows, "missing": missing}, indent=2))
    with open(root / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if k == "coded_ratio" and math.isnan(r[k]) else r[k] for k in COLUMNS})
    return rows


def ratio_or_dash(x: float | None, fmt: str = ".2f") -> str:
    """A ratio as printed in the tables: "—" where there is none (a run without coded sizes)."""
    return "—" if x is None or math.isnan(x) else ("∞" if math.isinf(x) else f"{x:{fmt}}")


TABLE_LEGEND = (
    "test acc %: mean ± std over seeds (the mean alone for one seed); Δ vs SGD: paired with SGD's run of "
    "the same seed, in points.",
    "uplink fixed-width: the uplink ratio = fp32 uplink bytes / uplink bytes really sent with the method's "
    "coding (headers, norms, scalers included; the paper's convention).",
    "uplink coded (auto): the same had every payload been coded with the best coding (AUTO: FIXED, Elias, "
    "zstd-aligned or rANS, measured on the steps of train.coded_every; — = not measured).",
    "total ratio: fixed-width over uplink and downlink; paper ratio: 32 / mean nominal bits (DQSGD Table 1's "
    "convention).")


def format_table(rows: list[dict[str, Any]], width: int = 100) -> str:
    """A Table 1-style text table (accuracy mean ± std over seeds, every ratio labelled) that fits
    ``width`` columns for method labels up to 20 characters; the legend is wrapped to ``width``."""
    import textwrap

    w = max([len("method"), *(len(r["method"]) for r in rows)]) + 2
    cols = [(14, "test acc %", "(mean ± std)"), (10, "Δ vs SGD", "(pt)"), (9, "uplink", "fixed"),
            (9, "uplink", "coded"), (7, "total", "ratio"), (7, "paper", "ratio"), (7, "mean", "bits"),
            (8, "MB", "up"), (8, "MB", "down")]
    lines = ["method".ljust(w) + "".join(f"{a:>{n}}" for n, a, _ in cols),
             "".ljust(w) + "".join(f"{b:>{n}}" for n, _, b in cols)]
    lines.append("-" * len(lines[0]))
    for r in rows:
        acc = f"{100 * r['test_acc_mean']:.2f}" + ("" if r.get("seeds") == 1 else f" ± {100 * r['test_acc_std']:.2f}")
        d = r["delta_vs_sgd_mean"]
        cells = [acc, "" if math.isnan(d) else f"{100 * d:+.2f}", f"{r['measured_ratio']:.2f}",
                 ratio_or_dash(r.get("coded_ratio")), f"{r['total_ratio']:.2f}", f"{r['paper_ratio']:.2f}",
                 f"{r['mean_bits']:.2f}", f"{r['up_bytes'] / 1e6:.2f}", f"{r['down_bytes'] / 1e6:.2f}"]
        lines.append(r["method"].ljust(w) + "".join(f"{c:>{n}}" for (n, _, _), c in zip(cols, cells)))
    lines += [textwrap.fill(item, width, subsequent_indent="  ") for item in TABLE_LEGEND]
    return "\n".join(lines)
