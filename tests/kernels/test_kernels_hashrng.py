"""The counter-based hash RNG: one definition, bit-identical in torch ops and numba, and a good
source of independent uniforms (KS and chi-square on 1M draws, across steps and workers)."""

import math

import numpy as np
import pytest
import torch

from dqsgd.kernels import HashRNG, hash_uniform_numpy
from dqsgd.kernels.hashrng import GAMMA, mix64

N = 1 << 20


def reference_uniform(rng: HashRNG, i: int) -> float:
    """u_i straight from the module docstring, in Python integers."""
    h = mix64(rng.key + (i // 4 + 1) * GAMMA)
    return (((h >> (16 * (i % 4))) & 0xFFFF) + 0.5) / 2**16


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 4096, 4097, 100_003])
def test_torch_and_compiled_uniforms_are_bit_identical(n: int) -> None:
    for rng in (HashRNG(0, 0, 0), HashRNG(2**63 - 1, 12345, 7), HashRNG(42, 2**40, 2**20)):
        t = rng.uniform(n)
        assert t.dtype == torch.float32 and t.shape == (n,)
        assert np.array_equal(t.numpy().view(np.uint32), hash_uniform_numpy(rng.key, n).view(np.uint32))


def test_uniforms_follow_the_documented_definition() -> None:
    rng = HashRNG(7, 3, 1)
    u = rng.uniform(1001).double().numpy()
    for i in (0, 1, 2, 3, 4, 5, 500, 998, 999, 1000):
        assert u[i] == reference_uniform(rng, i)
    m = u * 2**16 - 0.5  # every u is a midpoint (m + 1/2)·2^-16 of a 16-bit m, so 0 < u < 1
    assert np.array_equal(m, np.round(m)) and m.min() >= 0 and m.max() <= 2**16 - 1
    assert mix64(0) == 0 and mix64(GAMMA) == 0xE220A8397B1DCDAF  # SplitMix64(seed 0)'s first output


def test_keys_differ_for_every_triple_and_bad_arguments_are_refused() -> None:
    keys = {HashRNG(s, n, w).key for s in range(4) for n in range(50) for w in range(8)}
    assert len(keys) == 4 * 50 * 8
    assert HashRNG(1, 2, 3).key != HashRNG(1, 3, 2).key != HashRNG(2, 1, 3).key
    for bad in [(-1, 0, 0), (0, -1, 0), (0, 0, 1.5), (True, 0, 0)]:
        with pytest.raises(ValueError, match="HashRNG"):
            HashRNG(*bad)


def ks_statistic(u: np.ndarray) -> float:
    s = np.sort(u.astype(np.float64))
    i = np.arange(1, s.size + 1)
    return float(max((i / s.size - s).max(), (s - (i - 1) / s.size).max()))


def chi2_uniform(counts: np.ndarray) -> tuple[float, int]:
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum()), counts.size - 1


def chi2_bound(df: int) -> float:
    """≈ the 0.9999 quantile of chi-square(df) (Wilson–Hilferty, z = 3.72)."""
    z = 3.72
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("triple", [(0, 0, 0), (123456789, 17, 5)])
def test_one_million_draws_are_uniform(triple) -> None:
    u = hash_uniform_numpy(HashRNG(*triple).key, N)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert ks_statistic(u) < 1.95 / math.sqrt(N) + 2**-17  # KS 0.001 critical value (+ the 2^-16 grid)
    stat, df = chi2_uniform(np.bincount((u * 1024).astype(np.int64), minlength=1024))
    assert stat < chi2_bound(df)
    # Every 16-bit field is used: the four quarters of one 64-bit output agree in distribution.
    for k in range(4):
        quarter = u[k::4]
        assert ks_statistic(quarter) < 1.95 / math.sqrt(quarter.size) + 2**-17  # + the grid's own step
        stat, df = chi2_uniform(np.bincount((quarter * 256).astype(np.int64), minlength=256))
        assert stat < chi2_bound(df)


def pair_chi2(a: np.ndarray, b: np.ndarray, bins: int = 32) -> tuple[float, int]:
    cells = (a * bins).astype(np.int64) * bins + (b * bins).astype(np.int64)
    stat, _ = chi2_uniform(np.bincount(cells, minlength=bins * bins))
    return stat, (bins - 1) ** 2  # independence of two uniform margins


@pytest.mark.parametrize("other", [(0, 1, 0), (0, 0, 1), (1, 0, 0), (0, 1, 1)])
def test_streams_of_neighbouring_steps_and_workers_are_independent(other) -> None:
    a = hash_uniform_numpy(HashRNG(0, 0, 0).key, N)
    b = hash_uniform_numpy(HashRNG(*other).key, N)
    stat, df = pair_chi2(a, b)
    assert stat < chi2_bound(df)
    assert abs(np.corrcoef(a, b)[0, 1]) < 4 / math.sqrt(N)
    # Shifted alignment too (a stream that were a shifted copy of another would fail here).
    for lag in (1, 2, 4096):
        assert abs(np.corrcoef(a[lag:], b[:-lag])[0, 1]) < 4 / math.sqrt(N)


def test_neighbouring_coordinates_are_independent() -> None:
    u = hash_uniform_numpy(HashRNG(9, 9, 9).key, N)
    for k in range(3):  # neighbouring fields of one SplitMix64 output
        stat, df = pair_chi2(u[k::4], u[k + 1 :: 4])
        assert stat < chi2_bound(df)
    stat, df = pair_chi2(u[3:-1:4], u[4::4])  # across outputs
    assert stat < chi2_bound(df)
    stat, df = pair_chi2(u[0::4], u[3::4])  # the lowest and the highest field
    assert stat < chi2_bound(df)
