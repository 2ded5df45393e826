"""The DQSGD paper's theory set beside seeded Monte-Carlo measurements, with plots and a report.

    python -m dqsgd.experiments.theory_checks --out runs/theory [--quick]

writes ``results.json``, four PNG figures and ``report.md`` under ``--out``. The code lives in the
package :mod:`dqsgd.theory` (what each check simulates and claims is described there);
this module is the command and the old import path of its names.
"""

from __future__ import annotations

import sys

from dqsgd.theory.checks import (claims, equal_bits_check, proposition1_check, run_theory_checks,
                                             theorem1_check, theorem2_check)
from dqsgd.theory.cli import main
from dqsgd.theory.plots import plot_equal_bits, plot_prop1, plot_theorem1, plot_theorem2
from dqsgd.theory.report import write_report
from dqsgd.theory.settings import B_PRE, FULL, MAX_BITS, MIN_BITS, QUICK, Settings
from dqsgd.theory.sims import (Logistic, Widths, cell_variance, dqsgd_real_widths, dqsgd_widths,
                                           fixed_widths, levels, make_logistic, quantize_rows, row_norms, run_dqsgd,
                                           simulate_logistic, solve_k)
from dqsgd.theory.bounds import best_restart, effective_widths, theorem1_bounds, valid_totals

__all__ = ["B_PRE", "FULL", "Logistic", "MAX_BITS", "MIN_BITS", "QUICK", "Settings", "Widths", "best_restart",
           "cell_variance", "claims", "dqsgd_real_widths", "dqsgd_widths", "effective_widths", "equal_bits_check",
           "fixed_widths", "levels", "main", "make_logistic", "plot_equal_bits", "plot_prop1", "plot_theorem1",
           "plot_theorem2", "proposition1_check", "quantize_rows", "row_norms", "run_dqsgd", "run_theory_checks",
           "simulate_logistic", "solve_k", "theorem1_bounds", "theorem1_check", "theorem2_check", "valid_totals",
           "write_report"]

if __name__ == "__main__":
    sys.exit(main())
