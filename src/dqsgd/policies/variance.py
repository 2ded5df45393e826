"""σ², the sampling variance of the averaged gradient, from the workers' gradient norms [OC].

W workers compute g_i = ∇F + ξ_i with independent noises of covariance Σ (E ξ_i = 0). Their mean
ḡ = ∇F + ξ̄ has the noise trace σ² = tr Σ / W, the σ² of :mod:`dqsgd.policies.linktime`'s ρ. The
sum of squared deviations from the mean, Σ_i ‖g_i − ḡ‖² = Σ_i ‖g_i‖² − W‖ḡ‖², has the expectation
(W − 1)·tr Σ whatever ∇F is, so

    σ̂² = (Σ_i ‖g_i‖² − W·‖ḡ‖²) / (W·(W − 1))

is unbiased for σ² from W + 1 norms the step can compute (each worker's ‖g_i‖², and the mean's).
For Gaussian noise its variance is 2·tr(Σ²)/(W²·(W − 1)) (the deviations' sum is a quadratic form
of rank (W − 1)·d), 2σ⁴/(d·(W − 1)) when Σ is isotropic: relative error √(2/(d·(W − 1))), 0.05 % for
d = 3.2M and W = 4, so one step's estimate is already sharp and the smoothing only follows σ² as it
drifts over the run. The estimate is clipped at 0 (a rounding of the two sums can make it slightly
negative when the workers agree). :func:`smoothed` keeps an exponential average of the steps'
estimates, started at the first: a weighted mean of unbiased estimates with weights summing to 1,
so unbiased while σ² stays put.

**Where no process holds ḡ** (the DDP hook, the trainer over processes: :mod:`dqsgd.topology.exchange`)
rank r hands over ‖g_r‖² and its *realized* rounding error e_r = ‖Q(g_r) − g_r‖² (it decodes its own
payloads), and every rank holds the decoded update G. With independent unbiased roundings ε_r,
‖mean Q(g_r)‖² = ‖ḡ‖² + (2/W)Σ⟨ḡ, ε_r⟩ + (1/W²)Σ_r ‖ε_r‖² + (1/W²)Σ_{r≠k}⟨ε_r, ε_k⟩, so subtracting
Σ e_r/W² leaves ‖ḡ‖² plus terms of mean zero: unbiased, and with less variance than subtracting the
roundings' expected variance. A quantized downlink rounds the shards' means once more: its variance,
which no rank can observe (each shard server alone holds its shard's unrounded mean), is subtracted
as the model of :func:`modelled_rounding_variance` — the same model as the policy's q(B).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["modelled_rounding_variance", "pooled_variance", "smoothed", "worker_norms"]


def pooled_variance(sum_sq: float, mean_sq: float, workers: int, quant_var: float = 0.0) -> float:
    """σ̂² = (Σ‖g_i‖² − W‖ḡ‖²)/(W(W − 1)) (module docstring), at least 0.

    ``quant_var``: where ``mean_sq`` is the squared norm of the mean of the workers' *quantized*
    messages Q(g_i) (what a compressing step has, not ḡ), Σ_i E‖Q(g_i) − g_i‖² given the g_i: the
    roundings are unbiased and independent, so E‖mean Q(g_i)‖² = ‖ḡ‖² + quant_var/W², and
    ``mean_sq − quant_var/W²`` takes ‖ḡ‖²'s place (still unbiased)."""
    if workers < 2:
        raise ValueError(f"a variance across workers needs at least 2 workers, got {workers}")
    if not all(math.isfinite(v) and v >= 0 for v in (sum_sq, mean_sq, quant_var)):
        raise ValueError(f"norms and variances must be finite and >= 0, got {sum_sq}, {mean_sq}, {quant_var}")
    mean = mean_sq - quant_var / (workers * workers)
    return max(0.0, (sum_sq - workers * mean) / (workers * (workers - 1)))


def worker_norms(grads: Iterable[torch.Tensor]) -> tuple[float, float, int]:
    """(Σ_i ‖g_i‖², ‖ḡ‖², W) of the workers' gradients (summed in float64: the difference of the two
    sums is small against each when the workers agree)."""
    total, sum_sq, w = None, 0.0, 0
    for g in grads:
        flat = g.detach().reshape(-1).to(torch.float64)
        sum_sq += float(flat.dot(flat))
        total = flat.clone() if total is None else total.add_(flat)
        w += 1
    if total is None:
        raise ValueError("worker_norms needs at least one gradient")
    total.div_(w)
    return sum_sq, float(total.dot(total)), w


def smoothed(previous: float, estimate: float, smoothing: float) -> float:
    """The exponential average of the steps' estimates: ``estimate`` itself after none (``previous`` NaN)."""
    return estimate if math.isnan(previous) else (1 - smoothing) * previous + smoothing * estimate


def modelled_rounding_variance(g: torch.Tensor, bounds: Iterable[tuple[int, int]], levels: int, p: float) -> float:
    """Σ_j n_j·(‖g_j‖_p/s)²/6 over the shards [lo, hi) of ``bounds``: E‖Q_s(g) − g‖² of the stochastic
    uniform rounding of each shard at s = ``levels`` with its p-norm scale, when the fractional parts of
    the scaled coordinates are uniform (E f(1 − f) = 1/6; the policy's q(B)). Read off the rounded
    vector itself: under the max norm its scale is exactly its largest |coordinate|."""
    flat = g.detach().reshape(-1).to(torch.float64)
    total = 0.0
    for lo, hi in bounds:
        scale = float(torch.linalg.vector_norm(flat[lo:hi], p)) if hi > lo else 0.0
        total += (hi - lo) * (scale / levels) ** 2 / 6.0
    return total
