"""The hash-RNG quantizer is unbiased: Monte-Carlo over keys, tolerance from the exact variance; and
the bias left by 16-bit uniforms, computed exactly, is within its documented bound."""

import math

import pytest
import torch

from dqsgd.codecs import decode
from dqsgd.kernels import HashRNG, encode_uniform_fast, quantize_uniform_hash
from dqsgd.quantizers import Layout, Norm, dequantize

D, K = 64, 3000


def exact_variance(x: torch.Tensor, bits: int, scales: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Per-coordinate Var Q(x)_i: (r/s)²·f(1−f) for B ≥ 2, r² − x_i² for the 1-bit quantizer."""
    sizes = layout.segment_sizes(x.numel())
    r = torch.repeat_interleave(scales.double(), torch.tensor(sizes))
    xd = x.double()
    if bits == 1:
        return r**2 - xd**2
    s = (1 << (bits - 1)) - 1
    a = xd.abs() / r * s
    f = a - a.floor()
    return (r / s) ** 2 * f * (1 - f)


@pytest.mark.parametrize("bits,norm,layout", [
    (1, Norm.MAX, Layout()), (2, Norm.MAX, Layout()), (3, Norm.L2, Layout(bucket=16)), (4, Norm.MAX, Layout(bucket=20)),
])
def test_monte_carlo_mean_is_x_and_variance_is_the_formula(bits: int, norm: Norm, layout: Layout) -> None:
    x = torch.randn(D, generator=torch.Generator().manual_seed(bits)) * torch.linspace(0.1, 3, D)
    x[7] = 0.0
    acc = torch.zeros(D, dtype=torch.float64)
    sq = torch.zeros(D, dtype=torch.float64)
    for step in range(K):  # a new key per draw: the step counter of one worker
        xq = dequantize(decode(encode_uniform_fast(x, bits, HashRNG(5, step, 2), norm=norm, layout=layout))).double()
        acc += xq
        sq += xq**2
    mean = acc / K
    q0 = decode(encode_uniform_fast(x, bits, HashRNG(5, 0, 2), norm=norm, layout=layout))
    var = exact_variance(x, bits, q0.scales, layout)
    z = (mean - x.double()) / torch.sqrt(var / K).clamp_min(1e-30)
    exact = var == 0  # coordinates on a level (incl. the zero and the max) are never rounded
    assert torch.allclose(mean[exact], x.double()[exact], rtol=1e-6, atol=0)  # up to float32 rounding of r·c/s
    assert float(z[~exact].abs().max()) < 4.5  # 64 coordinates, each |z| > 4.5 has p ≈ 7e-6
    chi2 = float((z[~exact] ** 2).sum())  # ~ chi-square with (#coordinates) degrees of freedom
    dof = int((~exact).sum())
    assert chi2 < dof + 5 * math.sqrt(2 * dof)
    emp_var = sq / K - mean**2
    ratio = float(emp_var[~exact].sum() / var[~exact].sum())
    assert abs(ratio - 1) < 6 * math.sqrt(2 / K) + 0.02  # the summed variance matches the formula


class AllFields:
    """Every 16-bit uniform of :class:`HashRNG` once, in order: u_i = (i mod 2^16 + 1/2)·2^-16.

    The hash RNG draws each of these 2^16 values with probability 2^-16 (its fields are uniform:
    ``test_kernels_hashrng.py``), so the mean over one pass is the exact expectation."""

    def uniform(self, n: int, device: torch.device | str | None = None) -> torch.Tensor:
        m = torch.arange(n, dtype=torch.int64, device=device) % (1 << 16)
        return (m.to(torch.float32) + 0.5) * 2**-16


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_exact_bias_of_16_bit_uniforms_is_within_the_documented_bound(bits: int) -> None:
    """|E[Q(v)_i] − v_i| ≤ 2^-17·r/s (B ≥ 2) or 2^-16·r (B = 1): the bound in hashrng's docstring,
    checked exactly by averaging over all 2^16 uniforms (not by sampling)."""
    r, s = 1.5, 1 if bits == 1 else (1 << (bits - 1)) - 1
    bound = (2**-16 if bits == 1 else 2**-17 / s) * r
    vs = torch.rand(60, generator=torch.Generator().manual_seed(bits), dtype=torch.float64) * 2 * r - r
    vs = torch.cat([vs, torch.tensor([0.0, r, -r, r / s, r * (1 - 2**-20)], dtype=torch.float64)])
    worst = 0.0
    for v in vs.float().tolist():
        x = torch.full(((1 << 16) + 1,), v)
        x[-1] = r  # the last coordinate sets the max-norm to r
        xq = dequantize(quantize_uniform_hash(x, bits, AllFields())).double()  # type: ignore[arg-type]
        err = abs(float(xq[:-1].mean()) - v)
        assert err <= bound + r * 2**-22, (v, err, bound)  # + float32 rounding of |v|·s/r and of r·c/s
        worst = max(worst, err)
    assert worst > bound / 8  # the 16-bit resolution is visible: the bound is not vacuous
