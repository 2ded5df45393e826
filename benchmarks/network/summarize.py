"""One table and one figure from several ``bench_network.py`` runs (each its own ``--out`` folder).

    python benchmarks/network/summarize.py RUN_DIR [RUN_DIR ...] --out results/network
    python benchmarks/network/summarize.py RUN_DIR --readme "2-core AMD EPYC CPU, no GPU; 2026-11-26; load 1.2"

Writes ``summary.md`` (a Markdown table: per run setting and rate, each method's median time to
target, its speed-up against fp32 DDP and the fp16 hook, and the busiest rank's bytes per step) and
``summary.png`` (each method's speed-up over fp32 DDP in time to target, one panel per run setting,
one bar group per rate).
Each run's exact command comes from its ``network.json`` and is printed under the table.
``--readme NOTE`` writes instead each RUN_DIR's ``README.md``: its command, NOTE (machine, date, load)
and one row per (rate, method) with the time to target, the total wire bytes per step (all ranks) and
their ratio to fp32 DDP's, the step time and the final accuracy.
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
    fed = ", error-fed" if at and down.endswith("e") and down != "e" else ""
    down = down.removesuffix("e") if fed else down
    if not at:
        return base
    return base + (", both-leg budget" if down == "auto" else ", downlink fp32" if down == "fp32"
                   else f", downlink {down} bits") + fed


def setting(run: dict[str, Any]) -> str:
    """A run's name in the table: W, model and parameter count."""
    c = run["config"]
    model = c["model"] + (f" {c['hidden']}" if c.get("hidden") else "")
    return f"W = {c['workers']}, {model}, target {c['target']:.0%}"


def markdown(runs: list[dict[str, Any]], folders: list[str] | None = None) -> str:
    """The summary table; ``folders``: each run's folder name, shown before its setting."""
    lines = ["| setting | rate | method | time to target (s) | vs fp32 | vs fp16 | steps | busiest rank MB/step |",
             "|---|---|---|---|---|---|---|---|"]
    names = [f"`{f}`: " for f in folders] if folders else [""] * len(runs)
    for name, run in zip(names, runs):
        groups = grouped(run["runs"])
        for (rate, method), rows in groups.items():
            t = time_to_target(rows)
            if "error" in rows[0]:
                lines.append(f"| {name}{setting(run)} | {rate} | {label(method)} | failed: "
                             f"{rows[0]['error']} | — | — | — | — |")
                continue
            per_rank = max(rows[0]["wire_bytes_per_rank"]) / 1e6 / rows[0]["steps"]
            lines.append(f"| {name}{setting(run)} | {rate} | {label(method)} | "
                         f"{'—' if t is None else f'{t:.1f}'} | {speedup(groups, rate, method, 'fp32')} | "
                         f"{speedup(groups, rate, method, 'fp16')} | {rows[0]['steps']} | {per_rank:.3f} |")
    lines.append("")
    lines += [f"- {name}{setting(run)}: `{run.get('command', '(command not recorded)')}`" for name, run in zip(names, runs)]
    return "\n".join(lines) + "\n"


def run_table(run: dict[str, Any]) -> str:
    """One run as a Markdown table: per (rate, method) the median time to target [range over repeats],
    its speed-up over fp32 DDP, the total wire MB per step (all ranks, first repeat) and fp32 DDP's over
    it, ms per step and the final accuracy."""
    target = run["config"]["target"]
    lines = [f"| rate | row | time to {target:.0%} (s) | vs fp32 | wire MB/step | fp32 bytes / bytes | "
             "ms/step | final acc | steps |", "|---|---|---|---|---|---|---|---|---|"]
    groups = grouped(run["runs"])
    for (rate, method), rows in groups.items():
        if "error" in rows[0]:
            lines.append(f"| {rate} | `{method}` | failed: {rows[0]['error']} | — | — | — | — | — | — |")
            continue
        t, times = time_to_target(rows), [r["reached"]["train_s"] for r in rows if r.get("reached")]
        shown = "—" if t is None else f"{t:.1f}" + (f" [{min(times):.1f}–{max(times):.1f}]" if len(rows) > 1 else "")
        if t is None and times:
            shown += f" ({len(times)} of {len(rows)} repeats reached it)"
        mb = rows[0]["wire_bytes"] / 1e6 / rows[0]["steps"]
        ref = groups.get((rate, "fp32"))
        ratio = f"{ref[0]['wire_bytes'] / ref[0]['steps'] / 1e6 / mb:.1f}" if ref and "error" not in ref[0] else "—"
        lines.append(f"| {rate} | `{method}` ({label(method)}) | {shown} | {speedup(groups, rate, method, 'fp32')} | "
                     f"{mb:.3f} | {ratio} | {1000 * rows[0]['train_s'] / rows[0]['steps']:.0f} | "
                     f"{rows[0]['final_acc']:.4f} | {rows[0]['steps']} |")
    return "\n".join(lines) + "\n"


def readme(run: dict[str, Any], note: str) -> str:
    """A run folder's README.md: what produced it, where, and its table."""
    return (f"# {setting(run)}\n\n{note}\n\nCommand (`sudo` not needed as root; the checkout's `src` first on "
            f"PYTHONPATH):\n\n    {run.get('command', '(command not recorded)')}\n\n"
            f"Wire bytes: what the ranks' interfaces sent (TCP/IP and gloo framing included), first repeat; "
            f"times: training wall time on rank 0, medians over repeats.\n\n{run_table(run)}")


def figure(runs: list[dict[str, Any]], path: Path, folders: list[str] | None = None) -> None:
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
    for ax, run, folder in zip(axes.flat, runs, folders or [""] * len(runs)):
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
        ax.set(title=f"{folder}: {setting(run)}" if folder else setting(run), ylabel="speed-up over fp32 DDP (time to target)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="folders written by bench_network.py --out")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", help="folder for summary.md and summary.png")
    g.add_argument("--readme", metavar="NOTE", help="write each RUN_DIR's README.md, with NOTE (machine, date, load)")
    a = p.parse_args(argv)
    missing = [d for d in a.runs if not (Path(d) / "network.json").is_file()]
    if missing:
        print(f"summarize: no network.json in {missing}", file=sys.stderr)
        return 2
    runs = [json.loads((Path(d) / "network.json").read_text()) for d in a.runs]
    if a.readme is not None:
        for d, run in zip(a.runs, runs):
            (Path(d) / "README.md").write_text(readme(run, a.readme))
            print(f"{Path(d) / 'README.md'}")
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    folders = [Path(d).name for d in a.runs]
    text = markdown(runs, folders)
    (out / "summary.md").write_text(text)
    figure(runs, out / "summary.png", folders)
    print(text)
    print(f"{out / 'summary.md'}, {out / 'summary.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
