"""table1-fashion, sharded rows: 95% intervals from the summary.json that `dqsgd report` writes.

    python benchmarks/sharded_intervals.py RUN_DIR --sgd 88.81,88.11,88.74,88.53,88.56

RUN_DIR holds the sharded runs (no SGD runs: SGD's per-seed test accuracies, in percent, seeds 0, 1, ...,
come from ``--sgd``). Prints two Markdown tables: every method with its accuracy (Student-t 95% interval
over seeds), the paired difference to SGD with its interval, and the ratios and bytes of `dqsgd report`
as it computed them; then each ``*-auto`` row against its ``*-down8`` row, paired by seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dqsgd.experiments.stats import Interval, paired_interval


def pct(iv: Interval) -> str:
    """``88.55 [88.21, 88.89]`` (an interval of accuracies given as fractions, in percent)."""
    m, h = 100 * iv.mean, 100 * iv.half
    return f"{m:.2f}" if iv.n < 2 else f"{m:.2f} [{m - h:.2f}, {m + h:.2f}]"


def method_table(runs: list[dict[str, Any]], rows: list[dict[str, Any]], sgd: dict[int, float]) -> str:
    out = ["| method | seeds | test acc (%) [95% CI] | per seed | Δ vs SGD, pt [95% CI] | uplink ratio (sent) | "
           "total ratio (both legs) | MB up | MB down |", "|---|---:|---|---|---|---:|---:|---:|---:|"]
    for row in rows:
        rs = sorted((r for r in runs if r["method"] == row["method"]), key=lambda r: r["seed"])
        delta = paired_interval([r["test_acc"] - sgd[r["seed"]] for r in rs if r["seed"] in sgd])
        per_seed = ", ".join(f"{100 * r['test_acc']:.2f}" for r in rs)
        out.append(f"| `{row['method']}` | {','.join(str(r['seed']) for r in rs)} | "
                   f"{pct(paired_interval([r['test_acc'] for r in rs]))} | "
                   f"{per_seed} | {delta.fmt()} | "
                   f"{row['measured_ratio']:.2f} | {row['total_ratio']:.2f} | {row['up_bytes'] / 1e6:.2f} | "
                   f"{row['down_bytes'] / 1e6:.2f} |")
    return "\n".join(out)


def pair_table(runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    """Each ``X-auto`` against ``X-down8`` on the seeds both have: accuracy and total bytes sent."""
    by = {r["method"]: r for r in rows}
    out = ["| pair | seeds | Δ acc (auto − down8), pt [95% CI] | MB total, down8 → auto | total ratio, down8 → auto |",
           "|---|---:|---|---|---|"]
    for label in by:
        if not label.endswith("-auto") or label.replace("-auto", "-down8") not in by:
            continue
        ref = label.replace("-auto", "-down8")
        acc = {(r["method"], r["seed"]): r["test_acc"] for r in runs}
        seeds = sorted(s for (m, s) in acc if m == label and (ref, s) in acc)
        diff = paired_interval([acc[label, s] - acc[ref, s] for s in seeds])
        mb = [(by[m]["up_bytes"] + by[m]["down_bytes"]) / 1e6 for m in (ref, label)]
        out.append(f"| `{label}` − `{ref}` | {','.join(map(str, seeds))} | {diff.fmt()} | "
                   f"{mb[0]:.2f} → {mb[1]:.2f} | {by[ref]['total_ratio']:.2f} → {by[label]['total_ratio']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--sgd", required=True, help="SGD's test accuracies in percent, seeds 0, 1, ... (comma-separated)")
    args = ap.parse_args()
    summary = json.loads((args.run_dir / "summary.json").read_text())
    sgd = {s: float(a) / 100 for s, a in enumerate(args.sgd.split(","))}
    print(method_table(summary["runs"], summary["methods"], sgd) + "\n")
    print(pair_table(summary["runs"], summary["methods"]))


if __name__ == "__main__":
    main()
