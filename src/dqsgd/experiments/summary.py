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

import collections
import csv
import io
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from dqsgd.topology.registry import SIMULATED_DEFAULT, topology_of
from dqsgd.train import reader
from dqsgd.train.config import METHOD_TRAIN_KEYS
from dqsgd.train.rundir import differing, explain, resolved_of_facts
from dqsgd.train.runfiles import atomic_write

COLUMNS = ["method", "dataset", "stand_in_for", "model", "workers", "steps", "seeds", "test_acc_mean", "test_acc_std",
           "delta_vs_sgd_mean", "delta_vs_sgd_std", "measured_ratio", "coded_ratio", "total_ratio", "paper_ratio", "mean_bits", "up_bytes", "down_bytes", "rank_bytes",
           "topology", "wall_s"]


def run_dirs(root: Path) -> list[Path]:
    """The run directories under ``root`` (:func:`dqsgd.train.reader.run_dirs`: none in progress)."""
    return reader.run_dirs(root)


def _experiment(root: Path) -> dict[str, Any]:
    raw = reader.read_experiment(root)  # a regular file, bounded, nesting checked (file named on error)
    return raw if isinstance(raw, dict) else {}


def _table(raw: dict[str, Any], name: str) -> dict[str, Any]:
    t = raw.get(name, {})
    return t if isinstance(t, dict) else {}


def method_order(root: Path) -> list[str]:
    """Labels of ``[methods.*]`` in ``root/experiment.toml``, in the order the user wrote them ([] if absent)."""
    return list(_table(_experiment(root), "methods"))  # tomllib keeps the file's order


def missing_runs(root: Path, runs: list[dict[str, Any]]) -> list[str]:
    """``LABEL/seedK`` of every run ``root/experiment.toml`` asks for that has no run directory."""
    raw = _experiment(root)
    if not raw:
        return []
    seeds = _table(raw, "train").get("seeds", [0])
    have = {(r["method"], r["seed"]) for r in runs}
    return [f"{m}/seed{s}" for s in (seeds if isinstance(seeds, list) else [0]) for m in _table(raw, "methods")
            if (m, s) not in have]


def ordered_labels(labels: list[str], order: list[str] | None) -> list[str]:
    """``order`` first (those present), then the remaining labels in first-seen order."""
    seen = list(dict.fromkeys(labels))
    first = [m for m in (order or []) if m in seen]
    return first + [m for m in seen if m not in first]


class RunSums:
    """What the tables need of a run's records, gathered one record at a time (a run's records are never
    all held: a 2-million-step metrics.jsonl is streamed)."""

    def __init__(self) -> None:
        self.n = self.steps = self.up = self.down = self.side = self.coded_n = self.coded_up = self.coded_side = 0
        self.bits = self.wall = self.ranked = 0.0
        self.n_ranked = 0
        self.acc = float("nan")
        self.tail: collections.deque[float] = collections.deque(maxlen=20)

    def add(self, r: dict[str, Any]) -> None:
        self.n += 1
        self.wall += r["compute_s"] + r["encode_s"] + r["decode_s"]
        if r.get("test_acc") is not None:
            self.acc = r["test_acc"]
        if r.get("skipped"):
            return
        self.steps += 1
        self.up += int(r["up_bytes"])
        self.down += int(r["down_bytes"])
        self.side += int(r.get("side_bytes", 0))
        self.bits += r["bits"]
        if r.get("rank_total_bytes") is not None:
            self.ranked += r["rank_total_bytes"]
            self.n_ranked += 1
        if r.get("coded_up_bytes") is not None:
            self.coded_n += 1
            self.coded_up += int(r["coded_up_bytes"])
            self.coded_side += int(r.get("side_bytes", 0))
        loss = r.get("loss")
        self.tail.append(None if loss is None else float(loss))  # the writer's "inf" of a diverged run too


def summarize_run(run: Path) -> dict[str, Any]:
    facts = reader.read_facts(run)  # every number checked: file, line and field of a bad one
    acc = RunSums()
    for r in reader.run_records(run, facts):
        acc.add(r)
    return summary_of(facts, acc)


def summary_of(facts: dict[str, Any], acc: RunSums) -> dict[str, Any]:
    """A run's row from its config.json and the sums of its records."""
    w = facts["workers"]
    side = acc.side * w
    fp32 = 4 * facts["numel"] * w * acc.steps
    topology = facts["train_config"].get("topology") or SIMULATED_DEFAULT
    up, down = acc.up, acc.down
    sent = up + down + side
    fp32_all = fp32 * topology_of(topology).fp32_legs()
    mean_bits = acc.bits / acc.steps if acc.steps else float("nan")
    tail = [x for x in acc.tail if x is not None]
    coded_sent = acc.coded_up + acc.coded_side * w // 2
    coded_fp32 = 4 * facts["numel"] * w * acc.coded_n
    return {
        "method": facts["method"], "dataset": facts["dataset"], "stand_in_for": facts.get("stand_in_for"),
        "model": facts["train_config"]["model"], "workers": w, "seed": facts["seed"],
        "steps": acc.n, "test_acc": acc.acc,
        "train_loss": statistics.fmean(tail) if tail else float("nan"),
        "up_bytes": up, "down_bytes": down, "side_bytes": side, "topology": topology,
        "measured_ratio": fp32 / (up + side // 2) if up else (float("inf") if acc.steps else float("nan")),
        "coded_ratio": (coded_fp32 / coded_sent if coded_sent else float("inf")) if acc.coded_n else float("nan"),
        "coded_steps": acc.coded_n, "coded_up_bytes": acc.coded_up,
        "total_ratio": fp32_all / sent if sent else (float("inf") if acc.steps else float("nan")),
        "rank_bytes": acc.ranked / acc.n_ranked if acc.n_ranked else float("nan"),  # busiest rank, per step
        "paper_ratio": 32.0 / mean_bits if mean_bits else float("inf"), "mean_bits": mean_bits,
        "wall_s": acc.wall,
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
    atomic_write(root / "summary.json", json.dumps({"runs": runs, "methods": rows, "missing": missing}, indent=2))
    f = io.StringIO(newline="")
    w = csv.DictWriter(f, fieldnames=COLUMNS)
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if k == "coded_ratio" and math.isnan(r[k]) else r[k] for k in COLUMNS})
    atomic_write(root / "summary.csv", f.getvalue())  # never through a link planted in the output directory
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
