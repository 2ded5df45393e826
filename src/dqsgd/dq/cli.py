"""``python -m dqsgd.dq run|list`` (the lead wires it into the main CLI as ``dqsgd dq ...``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dqsgd.dq.algorithms import ALGORITHMS
from dqsgd.dq.config import DQConfigError, load, shipped

__all__ = ["main", "DEFAULT_CONFIGS", "build_parser"]

DEFAULT_CONFIGS = ("dq-mnist-logreg", "dq-mnist-mlp")  # the default full experiment


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dqsgd.dq", description="Double Quantization (AsyLPG family) "
                                 "on an asynchronous parameter server: run the shipped experiments.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run experiment config(s); writes runs/<name>/report.md")
    run.add_argument("--config", action="append", default=None,
                     help=f"shipped name or path (repeatable); default: {' + '.join(DEFAULT_CONFIGS)}")
    run.add_argument("--quick", action="store_true", help="tiny setting for tests: ≤800 samples, ≤4 workers, 2 epochs")
    run.add_argument("--out", default="runs", help="output root (default runs/)")
    run.add_argument("-o", "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override, e.g. -o run.lr=0.1 -o problem.subset=2000 -o methods.asylpg.mu=1.0")
    sub.add_parser("list", help="list the algorithms and the shipped dq-* configs")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "list":
        print("algorithms:")
        for a in ALGORITHMS.values():
            print(f"  {a.name:<14} {a.description}")
        print("configs:")
        for name, path in sorted(shipped().items()):
            first = path.read_text().splitlines()[0]
            print(f"  {name:<18} {first.lstrip('# ').strip()}")
        return 0
    try:
        exps = [load(c, args.overrides, is_quick=args.quick) for c in (args.config or DEFAULT_CONFIGS)]
    except DQConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from dqsgd.dq.experiment import run_experiment  # torch + data only once the configs are valid

    for exp in exps:
        run_experiment(exp, Path(args.out))
    return 0
