"""Sparse-AsyLPG's sparsifier: unbiased (Monte-Carlo, tolerance from the exact variance), its exact
second moment, the bounds that hold, and the counterexample to the one that does not."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dqsgd.dq.sparse import keep_probabilities, sparse_dequantize, sparse_quantize, sparsify


def _alpha(d: int, seed: int, spikes: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, generator=g)
    a[:spikes] *= 20.0  # a few large coordinates, so that some p_i are clipped at 1
    return a


def _moments(alpha: torch.Tensor, phi: float) -> tuple[float, float, bool]:
    """Exact E‖S(α)‖², E‖S(α) − α‖², and whether any p_i was clipped."""
    a = alpha.double()
    p = keep_probabilities(alpha, phi).double()
    nz = p > 0
    second = float((a[nz] ** 2 / p[nz]).sum())
    var = float((a[nz] ** 2 * (1 / p[nz] - 1)).sum())
    return second, var, bool((p == 1).any())


@pytest.mark.parametrize("phi_div", [2, 8])
def test_sparsifier_is_unbiased(phi_div: int) -> None:
    d, K = 64, 4000
    alpha = _alpha(d, 0)
    p = keep_probabilities(alpha, d / phi_div).double()
    gen = torch.Generator().manual_seed(1)
    total = torch.zeros(d, dtype=torch.float64)
    for _ in range(K):
        idx, vals = sparsify(alpha, d / phi_div, gen)
        total[idx] += vals.double()
    mean = total / K
    var_i = alpha.double() ** 2 * (1 / p - 1)
    z = (mean - alpha.double()).abs() / torch.sqrt(var_i / K).clamp_min(1e-12)
    assert float(z.max()) < 4.5  # 64 coordinates: P(max |z| > 4.5) < 64·7e-6
    assert torch.allclose(mean[p == 1], alpha.double()[p == 1])  # kept surely: exact


def test_sparsify_then_quantize_is_unbiased() -> None:
    d, K, b = 48, 2000, 3
    alpha = _alpha(d, 2)
    gen = torch.Generator().manual_seed(5)
    samples = torch.stack([sparse_dequantize(sparse_quantize(alpha, d / 4, b, gen)).double() for _ in range(K)])
    mean, se = samples.mean(0), samples.std(0) / math.sqrt(K)
    z = (mean - alpha.double()).abs() / se.clamp_min(1e-12)
    assert float(z.max()) < 4.5


@pytest.mark.parametrize("phi_div,spikes", [(2, 3), (8, 3), (16, 0), (64, 0)])
def test_second_moment_identity_and_bounds(phi_div: int, spikes: int) -> None:
    d = 512
    alpha = _alpha(d, 7, spikes)
    phi = d / phi_div
    second, var, clipped = _moments(alpha, phi)
    l1, l2sq = float(alpha.double().abs().sum()), float(alpha.double().square().sum())
    assert var <= l1 ** 2 / phi * (1 + 1e-12)                  # E‖S − α‖² ≤ ‖α‖₁²/φ
    assert l1 ** 2 / phi <= d / phi * l2sq * (1 + 1e-12)        # ≤ (d/φ)‖α‖₂²
    assert second <= l2sq + l1 ** 2 / phi * (1 + 1e-12)         # E‖S‖² ≤ ‖α‖₂² + ‖α‖₁²/φ
    if not clipped:
        assert math.isclose(second, l1 ** 2 / phi, rel_tol=1e-6)  # no clipping: E‖S‖² = ‖α‖₁²/φ exactly
    # Monte-Carlo agrees with the exact second moment
    gen, K = torch.Generator().manual_seed(phi_div), 2000
    sq = torch.tensor([float(sparsify(alpha, phi, gen)[1].double().square().sum()) for _ in range(K)],
                      dtype=torch.float64)
    assert abs(float(sq.mean()) - second) <= 5 * float(sq.std()) / math.sqrt(K) + 1e-9 * second


@settings(max_examples=100)
@given(vals=st.lists(st.floats(-100, 100, allow_nan=False), min_size=1, max_size=60), frac=st.floats(0.05, 1.0))
def test_brief_bound_holds_whenever_nothing_is_clipped(vals, frac) -> None:
    alpha = torch.tensor(vals, dtype=torch.float32)
    l1 = float(alpha.double().abs().sum())
    if l1 == 0:
        return
    phi = frac * l1 / float(alpha.abs().max())  # φ·max|α_i| ≤ ‖α‖₁: no p_i reaches 1 (frac < 1)
    second, _, clipped = _moments(alpha, phi)
    if not clipped:
        assert second <= l1 ** 2 / phi * (1 + 1e-6)


def test_brief_bound_fails_with_clipping_counterexample() -> None:
    """A commonly quoted bound says E‖S(α)‖² ≤ ‖α‖₁²/φ; with clipping it is false: α = e₁, φ = 4."""
    alpha = torch.tensor([1.0, 0.0, 0.0, 0.0])
    second, var, clipped = _moments(alpha, 4.0)
    assert clipped and second == 1.0 and var == 0.0 and second > 1.0 / 4.0


def test_expected_survivors_at_most_phi_and_zero_vector() -> None:
    alpha = _alpha(1000, 3)
    for phi in (10.0, 62.5, 250.0):
        assert float(keep_probabilities(alpha, phi).double().sum()) <= phi + 1e-6
    msg = sparse_quantize(torch.zeros(100), 6.0, 4, torch.Generator().manual_seed(0))
    assert msg.count == 0 and msg.delta == 0.0 and torch.equal(sparse_dequantize(msg), torch.zeros(100))
