"""One table and one figure from several ``bench_network.py`` runs (each its own ``--out`` folder).

    python benchmarks/network/summarize.py RUN_DIR [RUN_DIR ...] --out results/network

Writes ``summary.md`` (a Markdown table: per run setting and rate, each method's median time to
target, its speed-up against fp32 DDP and the fp16 hook, and the busiest rank's bytes per step) and
``summary.png`` (each method's speed-up over fp32 DDP in time to target, one panel per run setting,
one bar group per rate).
Each run's exact command comes from its ``network.json`` and is printed under the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from net_tables import grouped, speedup, time_to_target  # noqa: E402

LABELS = {"fp32": "fp32 DDP", "fp16": "fp16 hook", "powersgd": "PowerSGD rank 1", "qsgd-4bit": "QSGD-4 sharded",
          "dqsgd": "DQSGD sharded", "qsgd-4bit-allgather": "QSGD-4 all-gather", "dqsgd-allgather": "DQSGD all-gather",
          "qsgd-4bit-trainer": "QSGD-4 trainer (sharded)", "dqsgd-trainer": "DQSGD trainer (sharded)"}


def label(method: str) -> str:
    """A row's name in the summary: the fixed labels, else the method with its topology and downlink."""
    if method in LABELS:
        return LABELS[method]
    name, at, down = method.partition("@")
    rank = name.removeprefix("powersgd-r")
    base = f"PowerSGD rank {rank}" if name.startswith("powersgd-r") else LABELS.get(name, name)
    return base + (f", downlink {down} bits" if at and down != "fp32" else ", downlink fp32" if at else "")


def setting(run: dict[str, Any]) -> str:
    """A run's name in the table: W, model and parameter count."""
    c = run["config"]
    model = c["model"] + (f" {c['hidden']}" if c.get("hidden") else "")
    return f"W = {c['workers']}, {model}, target {c['target']:.0%}"


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = ["| setting | rate | method | time to target (s) | vs fp32 | vs fp16 | steps | busiest rank MB/step |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        groups = grouped(run["runs"])
        for (rate, method), rows in groups.items():
            t = time_to_target(rows)
            if "error" in rows[0]:
                lines.append(f"| {setting(run)} | {rate} | {label(method)} | failed: "
                             f"{rows[0]['error']} | — | — | — | — |")
                continue
            per_rank = max(rows[0]["wire_bytes_per_rank"]) / 1e6 / rows[0]["steps"]
            lines.append(f"| {setting(run)} | {rate} | {label(method)} | "
                         f"{'—' if t is None else f'{t:.1f}'} | {speedup(groups, rate, method, 'fp32')} | "
                         f"{speedup(groups, rate, method, 'fp16')} | {rows[0]['steps']} | {per_rank:.3f} |")
    lines.append("")
    lines += [f"- {setting(run)}: `{run.get('command', '(command not recorded)')}`" for run in runs]
    return "\n".join(lines) + "\n"


def figure(runs: list[dict[str, Any]], path: Path) -> None:
    """Speed-up over fp32 DDP (its median time to target / the method's) per method, one panel per run
    setting, one bar group per rate; a method has the same colour in every panel; × marks a miss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = list(dict.fromkeys([*LABELS, *(r["method"] for run in runs for r in run["runs"])]))
    colours = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(every)}
    cols = min(3, len(runs))
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(runs):]:
        ax.set_visible(False)
    for ax, run in zip(axes.flat, runs):
        groups = grouped(run["runs"])
        rates = list(dict.fromkeys(r for r, _ in groups))
        methods = [m for m in every if any((r, m) in groups for r in rates)]
        width = 0.8 / max(len(methods), 1)
        for i, m in enumerate(methods):
            for j, rate in enumerate(rates):
                ref = time_to_target(groups[(rate, "fp32")]) if (rate, "fp32") in groups else None
                t = time_to_target(groups[(rate, m)]) if (rate, m) in groups else None
                x = j + (i - (len(methods) - 1) / 2) * width
                if ref and t:
                    ax.bar(x, ref / t, width, color=colours[m], label=label(m) if j == 0 else None)
                else:  # missed the target, failed, or no fp32 row to compare with
                    ax.annotate("×", (x, 0), ha="center", va="bottom", color=colours[m])
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xticks(range(len(rates)), [f"{r} per link" for r in rates])
        ax.set(title=setting(run), ylabel="speed-up over fp32 DDP (time to target)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="folders written by bench_network.py --out")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    missing = [d for d in a.runs if not (Path(d) / "network.json").is_file()]
    if missing:
        print(f"summarize: no network.json in {missing}", file=sys.stderr)
        return 2
    runs = [json.loads((Path(d) / "network.json").read_text()) for d in a.runs]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(markdown(runs))
    figure(runs, out / "summary.png")
    print(markdown(runs))
    print(f"{out / 'summary.md'}, {out / 'summary.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
