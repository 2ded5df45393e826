"""``dqsgd dq run|list`` (also ``python -m dqsgd.dq run|list``).

Parsing imports nothing heavy: the algorithms (torch) load once a command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DONE = "dry run: nothing trained, nothing written"  # the last line of every --dry-run plan

__all__ = ["main", "DEFAULT_CONFIGS", "build_parser", "add_dq_arguments", "run_command"]

DESCRIPTION = "Double Quantization (AsyLPG family) on an asynchronous parameter server: run the shipped experiments."

DEFAULT_CONFIGS = ("dq-mnist-logreg", "dq-mnist-mlp")  # the default full experiment


def build_parser(prog: str = "python -m dqsgd.dq") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_dq_arguments(ap)
    return ap


def add_dq_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``run`` and ``list`` sub-commands, on ``ap`` (its own parser, or ``dqsgd dq``'s)."""
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="run|list")  # the metavar names it in errors
    run = sub.add_parser("run", help="run experiment config(s); writes runs/<name>/report.md")
    run.add_argument("--config", action="append", default=None,
                     help=f"shipped name or path (repeatable); default: {' + '.join(DEFAULT_CONFIGS)}")
    run.add_argument("--quick", action="store_true", help="tiny setting for tests: ≤800 samples, ≤4 workers, 2 epochs")
    run.add_argument("--out", default="runs", help="output root (default runs/)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="dotted override, e.g. --set run.lr=0.1 --set problem.subset=2000 "
                          "--set methods.asylpg.mu=1.0 (repeatable)")
    run.add_argument("--dry-run", action="store_true",
                     help="check the configs, overrides and data, print the plan, and stop (nothing is run or written)")
    run.add_argument("-o", dest="overrides", action="append", help=argparse.SUPPRESS)  # the old spelling of --set
    run.add_argument("--overwrite", action="store_true",
                     help="replace the results of an experiment with other settings in the output (default: refuse)")
    sub.add_parser("list", help="list the algorithms and the shipped dq-* configs")


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed ``run``/``list`` command; exit status 2 for a configuration error."""
    from dqsgd.dq.algorithms import ALGORITHMS
    from dqsgd.dq.config import DQConfigError, load, shipped

    if args.cmd == "list":
        print("algorithms:")
        for a in ALGORITHMS.values():
            print(f"  {a.name:<14} {a.description}")
        print("configs:")
        configs = sorted(shipped().items())
        width = max(len(name) for name, _ in configs)
        for name, path in configs:
            first = path.read_text().splitlines()[0]
            print(f"  {name:<{width}}  {first.lstrip('# ').strip()}")
        return 0
    try:
        exps = [load(c, args.overrides, is_quick=args.quick) for c in (args.config or DEFAULT_CONFIGS)]
    except DQConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("\n".join(dq_plan(exps, Path(args.out))))
        return 0
    from dqsgd.dq.experiment import run_experiment  # torch + data only once the configs are valid

    from dqsgd.train.runfiles import RunDirError

    try:
        for exp in exps:
            run_experiment(exp, Path(args.out), overwrite=args.overwrite)
    except (RunDirError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def dq_plan(exps: list, out_root: Path) -> list[str]:
    """The plan of ``dqsgd dq run``: each experiment's problem (data loaded, model built) and runs."""
    from dqsgd.dq.problem import Problem

    lines: list[str] = []
    for exp in exps:
        problem = Problem(exp.problem)
        runs = exp.runs()
        out = out_root / exp.spec.name
        lines += [f"dry run: dq {exp.spec.name} (config {exp.source})",
                  f"  problem: {exp.problem.dataset} / {exp.problem.model}, n = {problem.n}, d = {problem.d}",
                  f"  output: {out} ({'its files are replaced' if out.exists() else 'new'}); {len(runs)} runs: "
                  + ", ".join(f"{r.label} ({r.cfg.transport})" for r in runs)]
    return [*lines, DONE]
