"""Seed tables of a comparison (local-fashion, sketch-fashion): accuracy with 95% intervals, total bytes and
their ratio to synchronous fp32 SGD, and a figure of accuracy against total bytes (log scale), from the summary.json `dqsgd report` writes per tree.

    python benchmarks/seed_tables.py runs/local-fashion runs/local-fashion-dirichlet

prints the Markdown tables and writes results/local-fashion/acc_vs_bytes.png (from the repository root of
this checkout). With ``--no-figure`` first it only prints the tables (results/sketch-fashion uses it for its
compare/ tree).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dqsgd.experiments.stats import paired_interval  # noqa: E402

FIGURE = Path(__file__).resolve().parents[1] / "results" / "local-fashion" / "acc_vs_bytes.png"


def table(root: Path) -> list[dict]:
    runs = json.loads((root / "summary.json").read_text())["runs"]
    by: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by[r["method"]].append(r)
    sgd = {r["seed"]: r for r in by.get("sgd", [])}
    ref = sum(r["up_bytes"] + r["down_bytes"] + r["side_bytes"] for r in sgd.values()) / max(len(sgd), 1)
    ref_up = sum(r["up_bytes"] for r in sgd.values()) / max(len(sgd), 1)
    rows = []
    for m, rs in by.items():
        total = sum(r["up_bytes"] + r["down_bytes"] + r["side_bytes"] for r in rs) / len(rs)
        rows.append({"method": m, "seeds": sorted(r["seed"] for r in rs),
                     "acc": paired_interval([r["test_acc"] for r in rs]),
                     "delta": paired_interval([r["test_acc"] - sgd[r["seed"]]["test_acc"] for r in rs if r["seed"] in sgd]),
                     "up": sum(r["up_bytes"] for r in rs) / len(rs), "total": total,
                     "up_ratio": ref_up * len(rs) / sum(r["up_bytes"] for r in rs),
                     "ratio": ref / total if total else float("inf")})
    return rows


def markdown(name: str, rows: list[dict]) -> str:
    out = [f"### {name}", "", "| method | seeds | test acc (%) [95% interval] | Δ vs sync SGD (pt, paired) [95%] | "
           "MB up | uplink ratio vs sync fp32 SGD | MB total (up + down) | total-bytes ratio vs sync fp32 SGD |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        a = r["acc"]
        acc = f"{100 * a.mean:.2f}" + (f" [{100 * (a.mean - a.half):.2f}, {100 * (a.mean + a.half):.2f}]" if a.n > 1 else "")
        delta = "baseline" if r["method"] == "sgd" else r["delta"].fmt()
        out.append(f"| `{r['method']}` | {','.join(map(str, r['seeds']))} | {acc} | {delta} | {r['up'] / 1e6:.2f} | "
                   f"{r['up_ratio']:.1f} | {r['total'] / 1e6:.2f} | {r['ratio']:.1f} |")
    return "\n".join(out)


def main(roots: list[str]) -> None:
    if roots[:1] == ["--no-figure"]:
        for root in roots[1:]:
            print(markdown(Path(root).name, table(Path(root))) + "\n")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for root, marker in zip(roots, "os^"):
        rows = table(Path(root))
        print(markdown(Path(root).name, rows) + "\n")
        for r in rows:
            ax.scatter(r["total"], 100 * r["acc"].mean, marker=marker)
            ax.annotate(r["method"], (r["total"], 100 * r["acc"].mean), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("total bytes, all workers, uplink + downlink (log)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("local-fashion: LeNet-5, W = 8, 300 steps (o: IID, s: Dirichlet α = 0.1)")
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:])
