"""Quantizers tested as mathematics: unbiasedness (Monte-Carlo, tolerance from the variance),
the exact per-coordinate variance, Proposition 1, bounds, edge cases and bad input."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dqsgd.quantizers import (
    Layout, Norm, NonFiniteGradientError, Scheme, dequantize, majority_vote, quantize_identity, quantize_lowprec,
    quantize_sign, quantize_ternary, quantize_uniform, levels_for_bits, ternary_scalers,
)

M = 4000  # Monte-Carlo replicas


def replicas(g: torch.Tensor, m: int = M) -> tuple[torch.Tensor, Layout]:
    """m copies of g, each its own bucket (same norm): m independent quantizations in one call."""
    return g.repeat(m), Layout(bucket=g.numel())


def exact_var(g: torch.Tensor, bits: int, p: float) -> torch.Tensor:
    s = levels_for_bits(bits)
    r = g.abs().max() if math.isinf(p) else g.norm(2)
    a = g.abs() / r * s
    f = a - a.floor()
    return (r / s) ** 2 * f * (1 - f)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("norm", [Norm.MAX, Norm.L2])
def test_uniform_unbiased_and_exact_variance(bits: int, norm: Norm) -> None:
    gen = torch.Generator().manual_seed(bits * 7 + int(norm))
    g = torch.randn(48, generator=gen)
    x, layout = replicas(g)
    q = dequantize(quantize_uniform(x, bits, gen, norm=norm, layout=layout)).view(M, -1).double()
    var = exact_var(g, bits, math.inf if norm == Norm.MAX else 2.0).double()
    mean = q.mean(0)
    se = (var / M).sqrt()
    # Unbiased: every coordinate's mean within 5 standard errors (exact where the variance is 0).
    assert torch.all((mean - g.double()).abs() <= 5 * se + 1e-6)
    # The exact per-coordinate variance (‖g‖/s)² f(1-f): compare the total, with the MC error of the
    # sample variance (for a two-point variable, sd(sample var) ≤ var·sqrt(2/(M-1)) + 4th-moment term).
    emp = q.var(0, unbiased=True).sum()
    tol = 5 * math.sqrt(float((var**2).sum()) * 4 / M) + 1e-9
    assert abs(float(emp) - float(var.sum())) <= tol
    s = levels_for_bits(bits)
    r = float(g.abs().max() if norm == Norm.MAX else g.norm())
    assert float(var.sum()) <= g.numel() * r * r / (4 * s * s) + 1e-9  # worst case d·r²/(4s²)


@pytest.mark.parametrize("bits", [2, 4, 6])
def test_proposition1_variance_when_fractions_uniform(bits: int) -> None:
    """d/(6s²)‖g‖² holds when |g_i|/r·s has a uniform fractional part (Prop. 1's assumption)."""
    gen = torch.Generator().manual_seed(bits)
    s, d, vecs = levels_for_bits(bits), 256, 200
    totals = []
    for _ in range(vecs):
        lev = torch.randint(0, s, (d,), generator=gen).double()
        frac = torch.rand(d, generator=gen, dtype=torch.float64)
        g = ((lev + frac) / s).float() * torch.where(torch.rand(d, generator=gen) < 0.5, -1.0, 1.0)
        g[0] = 1.0  # the max-norm is exactly 1
        x, layout = replicas(g, 64)
        q = dequantize(quantize_uniform(x, bits, gen, layout=layout)).view(64, -1)
        totals.append(float(((q - g) ** 2).sum(1).mean()))
    predicted = d / (6 * s * s)
    mean = sum(totals) / vecs
    sd = (sum((t - mean) ** 2 for t in totals) / (vecs - 1)) ** 0.5
    assert abs(mean - predicted) <= 5 * sd / math.sqrt(vecs) + 0.02 * predicted


def test_uniform_levels_never_exceed_s_and_sign_kept() -> None:
    # Values whose |g|·s/max rounds above s in float32 (docs/design.md: seen at s = 127).
    g = torch.tensor([1.0, -1.0, 0.99999994, -0.99999994, 1e-38, 0.0])
    for bits in range(2, 17):
        q = quantize_uniform(g * 3.3, bits, torch.Generator().manual_seed(0))
        assert int(q.codes.abs().max()) <= levels_for_bits(bits)
        assert q.codes[0] > 0 and q.codes[1] < 0 and q.codes[5] == 0


@pytest.mark.parametrize("fn", [
    lambda x: quantize_uniform(x, 4), lambda x: quantize_sign(x), lambda x: quantize_ternary(x),
    lambda x: quantize_identity(x), lambda x: quantize_lowprec(x, 4),
])
def test_empty_tensors_round_trip_through_the_codec(fn) -> None:
    from dqsgd.codecs import decode, encode

    q = fn(torch.zeros(0))
    assert dequantize(decode(encode(q))).numel() == 0


def test_uniform_zero_empty_and_single() -> None:
    z = quantize_uniform(torch.zeros(10), 4)
    assert torch.equal(dequantize(z), torch.zeros(10)) and float(z.scales[0]) == 0.0
    e = quantize_uniform(torch.zeros(0), 4)
    assert e.codes.numel() == 0 and dequantize(e).shape == (0,)
    one = quantize_uniform(torch.tensor([-2.5]), 3)
    assert torch.equal(dequantize(one), torch.tensor([-2.5]))  # |g|/‖g‖∞ = 1 exactly: no randomness


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("fn", [
    lambda x: quantize_uniform(x, 4), lambda x: quantize_sign(x), lambda x: quantize_ternary(x),
    lambda x: quantize_identity(x), lambda x: quantize_lowprec(x, 4),
])
def test_non_finite_input_refused(bad: float, fn) -> None:
    x = torch.randn(100)
    x[37] = bad
    with pytest.raises(NonFiniteGradientError, match="NaN or Inf"):
        fn(x)


@pytest.mark.parametrize("bits", [0, 1, 17, -3])
def test_uniform_bits_out_of_range(bits: int) -> None:
    with pytest.raises(ValueError, match=r"bits must be in \[2, 16\]"):
        quantize_uniform(torch.randn(5), bits)


def test_uniform_rejects_integer_tensors() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        quantize_uniform(torch.arange(5), 4)


def test_bucketed_norms_are_per_bucket() -> None:
    g = torch.cat([torch.full((4,), 1.0), torch.full((4,), 100.0), torch.full((2,), 7.0)])
    q = quantize_uniform(g, 4, layout=Layout(bucket=4))
    assert q.scales.tolist() == [1.0, 100.0, 7.0]
    assert torch.equal(dequantize(q), g)  # every |g_i| equals its bucket max: exact


def test_ternary_unbiased_inside_the_clip_range() -> None:
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(32, generator=gen)
    scaler = float(g.abs().max())  # no clipping: unbiased everywhere
    x, layout = replicas(g)
    scalers = torch.full((M,), scaler)
    q = dequantize(quantize_ternary(x, gen, layout=layout, scalers=scalers)).view(M, -1).double()
    var = g.double().abs() * (scaler - g.double().abs())  # t = ±S w.p. |g|/S: Var = |g|(S-|g|)
    assert torch.all((q.mean(0) - g.double()).abs() <= 5 * (var / M).sqrt() + 1e-6)
    assert set(q.unique().tolist()) <= {-scaler, 0.0, scaler}


def test_ternary_clips_to_c_sigma() -> None:
    g = torch.cat([torch.randn(999, generator=torch.Generator().manual_seed(1)), torch.tensor([100.0])])
    s = ternary_scalers(g, clip=2.5)
    assert float(s[0]) == pytest.approx(2.5 * float(g.std(unbiased=False)), rel=1e-5)
    q = dequantize(quantize_ternary(g, torch.Generator().manual_seed(0), scalers=s))
    assert float(q[-1]) == pytest.approx(float(s[0]))  # the outlier became +S (clipped), always


def test_sign_and_majority_vote() -> None:
    g = torch.tensor([0.5, -2.0, 0.0, 3.0])
    q = quantize_sign(g)
    assert q.codes.tolist() == [1, -1, 1, 1] and q.bits == 1
    qs = quantize_sign(g, scaled=True)
    assert torch.allclose(dequantize(qs), torch.tensor([1.375, -1.375, 1.375, 1.375]))
    votes = [torch.tensor([1, -1, 1]), torch.tensor([1, 1, -1]), torch.tensor([-1, -1, -1]), torch.tensor([1, -1, 1])]
    assert majority_vote(votes).tolist() == [1, -1, 1]  # third coordinate ties 2-2 -> +1


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_lowprec_unbiased_and_variance_bound(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    g = torch.randn(32, generator=gen)
    qs = torch.stack([dequantize(quantize_lowprec(g, bits, gen)) for _ in range(1500)]).double()
    delta = float(g.abs().max()) / (2 ** (bits - 1) - 1)
    assert torch.all((qs.mean(0) - g.double()).abs() <= 5 * math.sqrt(delta**2 / 4 / 1500) + 1e-6)
    assert float(((qs - g.double()) ** 2).sum(1).mean()) <= g.numel() * delta**2 / 4 * 1.1


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(2, 16), st.integers(0, 7), st.floats(1e-6, 1e6))
def test_uniform_error_bounded_by_one_level(n: int, bits: int, bucket: int, scale: float) -> None:
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * scale
    q = quantize_uniform(g, bits, torch.Generator().manual_seed(1), layout=Layout(bucket=bucket))
    err = (dequantize(q) - g).abs()
    step = torch.repeat_interleave(q.scales / q.levels, torch.tensor(q.layout.segment_sizes(n), dtype=torch.long)) if n else err
    assert torch.all(err <= step * (1 + 1e-5) + 1e-30)


def test_empty_segment_and_denormal_norm() -> None:
    q = quantize_uniform(torch.tensor([1.0, -2.0, 3.0]), 4, layout=Layout(sizes=(2, 0, 1)))
    assert q.scales.tolist() == [2.0, 0.0, 3.0]
    with pytest.raises(ValueError, match="too small"):
        quantize_uniform(torch.tensor([1e-44, 0.0]), 8)
