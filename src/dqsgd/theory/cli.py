"""``python -m dqsgd.experiments.theory_checks --out DIR [--quick]`` (also ``python -m dqsgd.theory``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import dqsgd.theory as package
import dqsgd.theory.checks as checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dqsgd.experiments.theory_checks", description=package.__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/theory"), help="output folder (default runs/theory)")
    ap.add_argument("--quick", action="store_true", help="fewer runs and budgets (≈ 20 s)")
    args = ap.parse_args(argv)
    res = checks.run_theory_checks(args.out, quick=args.quick)
    print(f"wrote {args.out}/report.md, results.json and {len(res['plots'])} figures in {res['elapsed_s']:.0f} s")
    for k, v in res["checks"].items():
        print(f"  {k}: {v}")
    return 0
