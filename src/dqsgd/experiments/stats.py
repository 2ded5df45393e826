"""Paired differences over seeds with their 95% confidence intervals (Student t).

Methods are compared seed by seed (the same seed gives every method the same initial model and the
same minibatches), so the differences d_s = acc(method, s) − acc(reference, s) are i.i.d. over seeds
and their mean has the t interval  mean ± t_{0.975, n−1} · sd / √n. A difference is called
*significant* when that interval excludes 0 (a two-sided test at the 5% level).

The quantiles are tabulated here (the project does not depend on SciPy) and are checked against
the closed forms for 1 and 2 degrees of freedom and against the normal limit in the tests.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# t_{0.975, df}: two-sided 95% quantiles of Student's t (standard tables, 3 decimals).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
         29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (between tabulated df: the next
    smaller one, which is the wider, conservative interval; beyond 120: the normal 1.960)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom (2 seeds), got {df}")
    if df > 120:
        return 1.960
    return _T975[max(k for k in _T975 if k <= df)]


@dataclass(frozen=True)
class Interval:
    mean: float
    half: float       # half-width of the 95% interval (nan with fewer than 2 values)
    n: int

    @property
    def significant(self) -> bool:
        """The 95% interval excludes 0 (needs n ≥ 2)."""
        return self.n >= 2 and abs(self.mean) > self.half

    def fmt(self, scale: float = 100.0) -> str:
        """``+0.12 [−0.05, +0.29]`` in ``scale`` units (points for accuracies given as fractions)."""
        m = scale * self.mean
        if self.n < 2:
            return f"{m:+.2f} (1 seed)"
        h = scale * self.half
        return f"{m:+.2f} [{m - h:+.2f}, {m + h:+.2f}]"


def paired_interval(diffs: list[float]) -> Interval:
    """Mean and 95% t interval of paired differences (NaNs dropped)."""
    xs = [x for x in diffs if not math.isnan(x)]
    if not xs:
        return Interval(math.nan, math.nan, 0)
    if len(xs) == 1:
        return Interval(xs[0], math.nan, 1)
    return Interval(statistics.fmean(xs), t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs)), len(xs))
