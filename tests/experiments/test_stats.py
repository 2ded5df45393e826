"""Paired 95% t intervals: the tabulated quantiles and the interval's coverage."""

import math
import random
import statistics

import pytest

from dqsgd.experiments.stats import Interval, paired_interval, t975


def test_quantiles_match_closed_forms_and_the_normal_limit() -> None:
    assert t975(1) == pytest.approx(math.tan(math.pi * 0.475), abs=1e-3)   # Cauchy: tan(π(p − ½))
    assert t975(2) == pytest.approx(0.95 / math.sqrt(2 * 0.975 * 0.025), abs=1e-3)  # (2p−1)/√(2p(1−p))
    assert t975(1000) == 1.960
    values = [t975(df) for df in range(1, 200)]
    assert all(b <= a for a, b in zip(values, values[1:]))  # decreasing towards 1.96
    assert t975(35) == t975(30)  # between tabulated df: the wider one
    with pytest.raises(ValueError, match="2 seeds"):
        t975(0)


def test_interval_of_known_values() -> None:
    iv = paired_interval([0.01, 0.03, 0.02, 0.04, 0.00])
    sd = statistics.stdev([0.01, 0.03, 0.02, 0.04, 0.00])
    assert iv.mean == pytest.approx(0.02) and iv.half == pytest.approx(2.776 * sd / math.sqrt(5)) and iv.n == 5
    assert iv.significant  # [0.0004, 0.0396] excludes 0
    assert not paired_interval([0.01, -0.01, 0.02, -0.02]).significant
    assert paired_interval([0.5]).fmt() == "+50.00 (1 seed)" and not paired_interval([0.5]).significant
    assert paired_interval([]).n == 0 and paired_interval([math.nan, 0.1]).n == 1
    assert Interval(0.001, 0.002, 5).fmt() == "+0.10 [-0.10, +0.30]"


def test_coverage_is_95_percent_for_normal_differences() -> None:
    """Monte Carlo: 4,000 samples of 5 normal differences; the interval holds the true mean in 95% of them
    (binomial sd 0.34%, so the tolerance of 1.2% is 3.5 sd)."""
    rng = random.Random(7)
    trials, hits = 4000, 0
    for _ in range(trials):
        iv = paired_interval([rng.gauss(0.3, 1.0) for _ in range(5)])
        hits += abs(iv.mean - 0.3) <= iv.half
    assert hits / trials == pytest.approx(0.95, abs=0.012)
