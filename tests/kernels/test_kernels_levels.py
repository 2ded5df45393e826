"""The policies' level kernels against the torch operations they replace."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dqsgd.kernels.levels import expected_level_entropies


def torch_entropy(g: torch.Tensor, norm: float, s: int) -> float:
    """Entropy of the expected level histogram as ``torch.bincount`` of both roundings (the former policy code)."""
    u = (g.abs() / norm).clamp(max=1.0)
    sign = torch.where(g < 0, -1, 1).to(torch.int64)
    v = u * s
    low = v.floor()
    frac = v - low
    low = low.to(torch.int64)
    high = (low + 1).clamp(max=s)
    p = torch.bincount(torch.cat([s + sign * low, s + sign * high]), weights=torch.cat([1.0 - frac, frac]),
                       minlength=2 * s + 1)
    p = p[p > 0] / g.numel()
    return float(-(p * torch.log2(p)).sum())


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31 - 1), norm=st.floats(0.05, 10.0), zeros=st.booleans())
def test_matches_the_torch_histogram(n: int, seed: int, norm: float, zeros: bool) -> None:
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if zeros:
        g[::3] = 0.0
        g[1::7] = -0.0
    levels = [(1 << (b - 1)) - 1 for b in range(2, 17)]
    u = (g.abs() / norm).clamp(max=1.0).numpy()
    got = expected_level_entropies(u, (g < 0).numpy(), levels)
    # The fractions are summed in 32.32 fixed point: each probability is off by < 2^-32.
    assert got == pytest.approx([torch_entropy(g, norm, s) for s in levels], rel=1e-8, abs=1e-8)


def test_hand_computed() -> None:
    # s = 1: u = 0.25 → level 0 w.p. 3/4, 1 w.p. 1/4; the negative one mirrors it; u = 1 → level ±1 surely.
    u, neg = np.array([0.25, 0.25, 1.0]), np.array([False, True, True])
    p = np.array([0.25, 0.75 + 0.75, 0.25 + 1.0]) / 3  # levels +1, 0, −1
    want = -sum(x * math.log2(x) for x in p)
    assert expected_level_entropies(u, neg, [1])[0] == pytest.approx(want, rel=1e-12)
    assert expected_level_entropies(np.zeros(0), np.zeros(0, bool), [1, 3]) == [0.0, 0.0]
    assert expected_level_entropies(np.zeros(5), np.zeros(5, bool), [1, 3]) == [0.0, 0.0]


def test_refuses_bad_inputs() -> None:
    with pytest.raises(ValueError, match="float64"):
        expected_level_entropies(np.zeros(3, np.float32), np.zeros(3, bool), [3])
    with pytest.raises(ValueError, match="s ≥ 1"):
        expected_level_entropies(np.zeros(3), np.zeros(3, bool), [0])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        expected_level_entropies(np.array([0.5, np.nan]), np.zeros(2, bool), [3])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 3000), seed=st.integers(0, 2**31 - 1), scale=st.floats(0.3, 3.0), double=st.booleans())
def test_values_give_the_entropies_of_their_magnitudes_bit_for_bit(n: int, seed: int, scale: float,
                                                                  double: bool) -> None:
    """value_level_entropies computes u = min(|g|/norm, 1) and the signs in its kernel: the same floats,
    so the same entropies, as torch's ops feeding expected_level_entropies (the policy's former code)."""
    from dqsgd.kernels.levels import value_level_entropies

    g = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64 if double else torch.float32)
    g[::4] = 0.0
    g[1::9] = -0.0
    norm = scale * max(float(g.abs().max()) if n else 0.0, 1e-3)  # > 0: an all-zero g keeps a scale
    g64 = g.to(torch.float64)
    levels = [(1 << (b - 1)) - 1 for b in range(2, 17)]
    want = expected_level_entropies((g64.abs() / norm).clamp(max=1.0).numpy(), (g64 < 0).numpy(), levels)
    assert value_level_entropies(g.numpy(), norm, levels) == want
    with pytest.raises(ValueError, match="scale"):
        value_level_entropies(g.numpy(), 0.0, levels)
