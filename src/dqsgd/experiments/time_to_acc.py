"""Time-to-accuracy in simulated seconds, from runs' metrics (the clock of :mod:`dqsgd.train.slownodes`).

A run reaches accuracy ``target`` at its first evaluation with ``test_acc >= target``; its time is that
step's cumulative ``sim_time_s`` (so the resolution is ``train.eval_every`` steps); a seed still running
counts once it has reached the target. For each variant the
seeds' times give a mean with a 95% t interval; the speed-up over the baseline variant is paired by seed
(t_baseline / t_variant, the same seed meaning the same data and initial model) with its 95% interval.

    python -m dqsgd.experiments.time_to_acc --target 0.75 sync=RUN/sgd b1=RUN_B1/sgd dqsgd=RUN/dqsgd

Each ``NAME=DIR`` is a method's folder of a run (``DIR/seed<k>/metrics.jsonl``); the first is the baseline.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Sequence

from dqsgd.experiments.stats import Interval, paired_interval, t975
from dqsgd.train import reader
from dqsgd.train.runfiles import inside


def time_to_accuracy(metrics: Path, target: float) -> float:
    """The simulated seconds at the first evaluation reaching ``target`` (inf: never reached)."""
    for rec in reader.read_records(metrics):  # every number checked, bad ones named by file and line
        if rec.get("test_acc", -1.0) >= target:
            t = rec.get("sim_time_s")
            if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise ValueError(f"{metrics}: step {rec.get('step')}: no valid sim_time_s ({t!r}; a run from "
                                 f"before the simulated clock?)")
            return float(t)
    return math.inf


def seed_times(method_dir: Path, target: float) -> dict[int, float]:
    """seed -> time-to-accuracy of every seed of ``method_dir`` that finished or already reached the
    target (later steps cannot change when it was first reached)."""
    out = {}
    for seed_dir in sorted(inside(method_dir, d) for d in method_dir.glob("seed*")):  # no seed dir through a link
        t = time_to_accuracy(seed_dir / "metrics.jsonl", target) if (seed_dir / "metrics.jsonl").exists() else math.inf
        if (seed_dir / "summary.json").exists() or math.isfinite(t):
            out[int(seed_dir.name[4:])] = t
    return out


def _interval(xs: list[float]) -> Interval:
    if len(xs) < 2 or any(math.isinf(x) for x in xs):
        return Interval(statistics.fmean(xs) if xs else math.nan, math.nan, len(xs))
    return Interval(statistics.fmean(xs), t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs)), len(xs))


def _fmt(iv: Interval, unit: str = "") -> str:
    if not iv.n or math.isinf(iv.mean):
        return "—"
    if iv.n < 2 or math.isnan(iv.half):
        return f"{iv.mean:.1f}{unit} ({iv.n} seed{'s' if iv.n != 1 else ''})"
    return f"{iv.mean:.1f}{unit} [{iv.mean - iv.half:.1f}, {iv.mean + iv.half:.1f}]"


def table(variants: Sequence[tuple[str, Path]], target: float) -> str:
    """A Markdown table: per variant its seeds, mean time-to-accuracy and paired speed-up over the first."""
    times = {name: seed_times(path, target) for name, path in variants}
    base_name = variants[0][0]
    base = times[base_name]
    lines = [f"| variant | seeds | time to {100 * target:.0f}% (simulated s, 95% interval) | "
             f"speed-up over {base_name} (paired, 95% interval) |", "|---|---|---|---|"]
    for name, _ in variants:
        mine = times[name]
        seeds = sorted(set(mine) & set(base))
        ups = [base[s] / mine[s] for s in seeds if math.isfinite(base[s]) and math.isfinite(mine[s])]
        up = paired_interval(ups)
        reached = sum(math.isfinite(t) for t in mine.values())
        speed = "—" if not ups else (f"{up.mean:.2f}×" + ("" if up.n < 2 else
                                                           f" [{up.mean - up.half:.2f}, {up.mean + up.half:.2f}]"))
        lines.append(f"| {name} | {reached}/{len(mine)} reached | {_fmt(_interval(list(mine.values())))} | {speed} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dqsgd.experiments.time_to_acc", description=__doc__.split("\n")[0])
    p.add_argument("--target", type=float, required=True, help="test accuracy to reach, a fraction (0.75)")
    p.add_argument("variants", nargs="+", help="NAME=DIR, DIR a method's folder of a run; the first is the baseline")
    args = p.parse_args(argv)
    variants = []
    for v in args.variants:
        name, sep, path = v.partition("=")
        if not sep or not Path(path).is_dir():
            p.error(f"{v!r}: need NAME=DIR with an existing DIR")
        variants.append((name, Path(path)))
    print(table(variants, args.target))


if __name__ == "__main__":
    main()
