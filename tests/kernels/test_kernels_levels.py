"""The policies' level kernels against the torch operations they replace, bit for bit."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dqsgd.kernels.levels import rounding_histogram


def torch_histogram(g: torch.Tensor, norm: float, s: int) -> torch.Tensor:
    """The expected level histogram as ``torch.bincount`` of both roundings (the former policy code)."""
    u = (g.abs() / norm).clamp(max=1.0)
    sign = torch.where(g < 0, -1, 1).to(torch.int64)
    v = u * s
    low = v.floor()
    frac = v - low
    low = low.to(torch.int64)
    high = (low + 1).clamp(max=s)
    return torch.bincount(torch.cat([s + sign * low, s + sign * high]), weights=torch.cat([1.0 - frac, frac]),
                          minlength=2 * s + 1)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31 - 1), bits=st.integers(2, 16),
       norm=st.floats(0.05, 10.0), zeros=st.booleans())
def test_matches_torch_bincount_bitwise(n: int, seed: int, bits: int, norm: float, zeros: bool) -> None:
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if zeros:
        g[::3] = 0.0
        g[1::7] = -0.0
    s = (1 << (bits - 1)) - 1
    want = torch_histogram(g, norm, s)
    u = (g.abs() / norm).clamp(max=1.0).numpy()
    got = rounding_histogram(u, (g < 0).numpy(), s)
    assert np.array_equal(got.view(np.int64), want.numpy().view(np.int64))  # the same float64 bits
    assert got.sum() == pytest.approx(n)


def test_refuses_bad_inputs() -> None:
    with pytest.raises(ValueError, match="float64"):
        rounding_histogram(np.zeros(3, np.float32), np.zeros(3, bool), 3)
    with pytest.raises(ValueError, match="s ≥ 1"):
        rounding_histogram(np.zeros(3), np.zeros(3, bool), 0)
