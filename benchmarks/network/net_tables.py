"""The tables and figure of ``bench_network.py``: medians over repeats, speed-ups, and curves.

Kept apart from the launcher so that ``summarize.py`` and the tests read results without starting ranks.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def link_s(row: dict[str, Any]) -> float:
    """Modelled network time: the busiest rank's bytes at the shaped rate (a lower bound on communication)."""
    from netns import rate_bits

    return 8 * max(row["wire_bytes_per_rank"]) / rate_bits(row["rate"])


def peak_step(row: dict[str, Any]) -> tuple[int, float] | None:
    """(the most bytes rank 0's interface sent in one training step, that step's seconds) from the row's trace of
    rank 0's clock and bytes after every step; None for a result without a trace (recorded before it existed)."""
    trace = row.get("trace") or []
    steps = [(b1 - b0, t1 - t0) for (t0, b0), (t1, b1) in zip([(0.0, 0), *trace], trace)]
    return max(steps) if steps else None


def time_to_target(runs: list[dict[str, Any]]) -> float | None:
    """Median over repeats of the training time to the target (None if any repeat missed it)."""
    times = [r["reached"]["train_s"] if r.get("reached") else None for r in runs]
    return None if None in times else statistics.median(times)


def grouped(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The runs of each (rate, method), in first-seen order."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["rate"], r["method"]), []).append(r)
    return out


def speedup(groups: dict[tuple[str, str], list[dict[str, Any]]], rate: str, method: str, ref: str) -> str:
    """``ref``'s median time to target over ``method``'s, at the same rate ("—" if either missed or is absent)."""
    if (rate, ref) not in groups:
        return "—"
    mine, theirs = time_to_target(groups[(rate, method)]), time_to_target(groups[(rate, ref)])
    return f"{theirs / mine:.2f}x" if mine and theirs else "—"


def table(rows: list[dict[str, Any]], target: float) -> str:
    """One line per (rate, method): median time to target (range over repeats), speed-ups against fp32
    DDP and the fp16 hook, and the first repeat's steps, accuracy, bytes, step time and the most bytes rank 0
    sent in one step (:func:`peak_step`)."""
    groups = grouped(rows)
    w = max([24, *(len(m) for _, m in groups)])
    head = (f"{'rate':>8} {'method':>{w}} {'time to ' + format(target, '.0%'):>17} {'vs fp32':>7} {'vs fp16':>7} "
            f"{'steps':>5} {'final acc':>9} {'MB/step':>8} {'link s':>7} {'ms/step':>8} {'sent ratio':>10} "
            f"{'peak MB/step':>12}")
    lines = [head, "-" * len(head)]
    for (rate, method), runs in groups.items():
        r, best = runs[0], time_to_target(runs)
        if "error" in r:
            lines.append(f"{rate:>8} {method:>{w}}   failed: {r['error']}")
            continue
        t = "—" if best is None else f"{best:.1f} s"
        if best is not None and len(runs) > 1:
            t += f" [{min(x['reached']['train_s'] for x in runs):.1f}-{max(x['reached']['train_s'] for x in runs):.1f}]"
        ratio = f"{r['payload_ratio']:.2f}" if r.get("payload_ratio") else "—"
        peak = peak_step(r)
        lines.append(f"{rate:>8} {method:>{w}} {t:>17} {speedup(groups, rate, method, 'fp32'):>7} "
                     f"{speedup(groups, rate, method, 'fp16'):>7} {r['steps']:>5} {r['final_acc']:>9.4f} "
                     f"{r['wire_bytes'] / 1e6 / r['steps']:>8.3f} {link_s(r):>7.1f} "
                     f"{1000 * r['train_s'] / r['steps']:>8.1f} {ratio:>10} "
                     f"{'—' if peak is None else format(peak[0] / 1e6, '.3f'):>12}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["rate"] for r in rows}, key=lambda x: rows.index(next(r for r in rows if r["rate"] == x)))
    fig, axes = plt.subplots(2, len(rates), figsize=(6 * len(rates), 8), squeeze=False)
    for j, rate in enumerate(rates):
        for r in (r for r in rows if r["rate"] == rate):
            if "error" in r:
                continue
            xs = [c["train_s"] for c in r["curve"]]
            axes[0][j].plot(xs, [c["acc"] for c in r["curve"]], marker=".", label=r["method"])
            axes[1][j].plot(xs, [c["tx_bytes"] / 1e6 for c in r["curve"]], marker=".", label=r["method"])
        axes[0][j].axhline(target, color="grey", ls=":", lw=1)
        axes[0][j].set(title=f"{rate} per link", xlabel="training wall time (s)", ylabel="test accuracy")
        axes[1][j].set(xlabel="training wall time (s)", ylabel="MB sent by rank 0's interface")
        axes[0][j].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
