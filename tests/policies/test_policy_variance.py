"""σ̂² from the workers' norms (policies/variance.py) as a statistic: unbiased on synthetic Gaussian
gradients, within a tolerance derived from its variance."""

import math

import numpy as np
import pytest
import torch

from dqsgd.policies.variance import pooled_variance, smoothed, worker_norms

D, R = 2000, 400  # coordinates, replicates
Z = 5.0  # the test fails by chance with probability < 1e-6 (a normal mean of R = 400 estimates)


def draws(rng, workers, diag, mean):
    """W worker gradients g_i = mean + N(0, diag(diag)) (float64)."""
    return mean + rng.standard_normal((workers, D)) * np.sqrt(diag)


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_unbiased_with_the_variance_it_should_have(workers):
    """E σ̂² = tr Σ / W for any mean gradient; one estimate has variance 2·tr(Σ²)/(W²(W−1)) (a quadratic
    form of Gaussians of rank (W−1)·d): the mean of R estimates is within Z standard errors, and their
    sample variance within Z standard errors of that variance (its own variance is 2v²/(R−1) for a
    normal sample: the estimate is a sum of d(W−1) independent terms)."""
    rng = np.random.default_rng(workers)
    diag = rng.uniform(0.5, 3.0, D)  # not isotropic
    mean = rng.standard_normal(D) * 4.0  # a gradient much larger than its noise
    est = []
    for _ in range(R):
        g = draws(rng, workers, diag, mean)
        sum_sq, mean_sq = float((g * g).sum()), float(g.mean(0) @ g.mean(0))
        est.append(pooled_variance(sum_sq, mean_sq, workers))
    est = np.array(est)
    sigma2 = diag.sum() / workers
    var = 2 * (diag ** 2).sum() / (workers ** 2 * (workers - 1))
    assert abs(est.mean() - sigma2) < Z * math.sqrt(var / R)
    assert abs(est.var(ddof=1) - var) < Z * var * math.sqrt(2 / (R - 1))


def test_unbiased_from_the_decoded_mean_with_the_quantization_variances():
    """The step has the mean of the workers' quantized messages Q(g_i) = g_i + e_i (independent, unbiased,
    E‖e_i‖² = v_i given g_i), not ḡ: with quant_var = Σ v_i the estimate stays unbiased. Its error is the
    raw estimate's plus B = −(2ḡ·ē + ‖ē‖² − Σv/W²)/(W−1), ē ~ N(0, τ I), τ = Σv/(W²d), which has
    E B = 0 and Var B = (4(‖μ‖² + tr Σ/W)τ + 2dτ²)/(W−1)²; so sd ≤ sd_raw + sd_B."""
    workers = 4
    rng = np.random.default_rng(7)
    diag = np.full(D, 1.0)
    mean = rng.standard_normal(D)
    v = np.array([0.5, 1.0, 2.0, 4.0]) * D  # each worker's quantization variance, summed over coordinates
    est, plain = [], []
    for _ in range(R):
        g = draws(rng, workers, diag, mean)
        msgs = g + rng.standard_normal((workers, D)) * np.sqrt(v[:, None] / D)
        m = msgs.mean(0)
        est.append(pooled_variance(float((g * g).sum()), float(m @ m), workers, float(v.sum())))
        plain.append(pooled_variance(float((g * g).sum()), float(m @ m), workers))
    sigma2 = diag.sum() / workers
    tau = v.sum() / (workers ** 2 * D)
    sd_raw = math.sqrt(2 * (diag ** 2).sum() / (workers ** 2 * (workers - 1)))
    sd_b = math.sqrt((4 * (mean @ mean + diag.sum() / workers) * tau + 2 * D * tau ** 2) / (workers - 1) ** 2)
    assert abs(np.mean(est) - sigma2) < Z * (sd_raw + sd_b) / math.sqrt(R)
    # without the correction it is biased low by Σv/(W²(W−1)), far beyond that margin: the correction matters
    assert sigma2 - np.mean(plain) > 10 * Z * (sd_raw + sd_b) / math.sqrt(R)


def test_worker_norms_are_the_sums_of_the_definition():
    rng = np.random.default_rng(3)
    g = rng.standard_normal((3, 1000)).astype(np.float32)
    sum_sq, mean_sq, w = worker_norms([torch.from_numpy(x) for x in g])
    g64 = g.astype(np.float64)
    assert w == 3
    assert sum_sq == pytest.approx(float((g64 * g64).sum()), rel=1e-12)
    assert mean_sq == pytest.approx(float(g64.mean(0) @ g64.mean(0)), rel=1e-12)


def test_identical_workers_have_no_variance_and_bad_figures_are_refused():
    g = torch.randn(100)
    assert pooled_variance(*worker_norms([g, g, g])) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="at least 2 workers"):
        pooled_variance(1.0, 1.0, 1)
    with pytest.raises(ValueError, match="finite"):
        pooled_variance(float("nan"), 1.0, 2)
    with pytest.raises(ValueError, match="at least one"):
        worker_norms([])


def test_smoothing_starts_at_the_first_estimate():
    assert smoothed(float("nan"), 2.0, 0.3) == 2.0
    assert smoothed(2.0, 4.0, 0.25) == pytest.approx(2.5)
