"""Compiled loops over quantization levels that the policies need every step.

:func:`expected_level_entropies` — for each of several level counts ``s``, the entropy (bits per
coordinate) of the signed levels that unbiased stochastic rounding produces: coordinate ``i``
(magnitude ``u_i ∈ [0, 1]`` of the scale, and a sign) lands on level ``ℓ_i = ⌊u_i·s⌋`` with
probability ``1 − f_i`` and on ``ℓ_i + 1`` with probability ``f_i = u_i·s − ℓ_i`` (``f_i = 0`` when
``ℓ_i = s``). The expected count of level ``+ℓ`` is

    P(+ℓ) = Σ_{i ≥ 0, ℓ_i = ℓ} (1 − f_i) + Σ_{i ≥ 0, ℓ_i = ℓ − 1} f_i = C⁺_ℓ − F⁺_ℓ + F⁺_(ℓ−1)

(``i ≥ 0``: the non-negative coordinates; ``C⁺_ℓ`` their count at ``ℓ_i = ℓ``, ``F⁺_ℓ`` the sum of their
``f_i``; level 0 gathers both signs' ``C_0 − F_0``), so one pass that adds 1 and ``f_i`` into the bin of
``(sign, ℓ_i)`` — one bin per coordinate and width, where two roundings would scatter into two — gives
every width's histogram. The fractions are added in 32.32 fixed point (``⌊f_i·2^32⌋``): integer sums,
exact and independent of the order of the coordinates (each probability is off by < 2^-32, and the
counts of a width sum to exactly n).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["expected_level_entropies", "value_level_entropies"]

_ONE = 1 << 32  # fixed point of the fractions


_PARTIAL_BELOW = 2048  # widths of fewer levels add into four partial tables (see _bins)


@njit(cache=True, nogil=True)
def _bins(u, neg, svals, offs, acc):  # pragma: no cover - compiled
    """acc[2·(offs_k + (s_k + 1)·neg_i + ℓ_i)] += 1 and acc[… + 1] += ⌊f_i·2^32⌋, for every i and width k.

    Width by width: a narrow width puts most coordinates into a few bins, and one table would chain
    every addition on the one before, so below ``_PARTIAL_BELOW`` levels coordinate i adds into
    partial table i mod 4 (summed at the end: integers, the same totals); a wide width spreads them."""
    n = u.size
    for k in range(svals.size):
        s = svals[k]
        sf = np.float64(s)
        base = 2 * offs[k]
        side = 2 * (s + 1)
        parts = 4 if s < _PARTIAL_BELOW else 1
        part = np.zeros((parts, 2 * side if parts > 1 else 0), np.int64)
        for i in range(n):
            v = u[i] * sf
            low = np.int64(np.floor(v))
            frac = np.int64((v - np.float64(low)) * np.float64(_ONE))
            j = side * np.int64(neg[i]) + 2 * low
            if parts > 1:
                part[i & 3, j] += 1
                part[i & 3, j + 1] += frac
            else:
                acc[base + j] += 1
                acc[base + j + 1] += frac
        if parts > 1:
            for j in range(2 * side):
                acc[base + j] += part[0, j] + part[1, j] + part[2, j] + part[3, j]


@njit(cache=True, nogil=True)
def _magnitudes(g, norm, u, neg):  # pragma: no cover - compiled
    """u_i = min(|g_i| / norm, 1) in float64 (NaN stays NaN), neg_i = g_i < 0: the values of torch's
    ``(g.double().abs() / norm).clamp(max=1.0)`` and ``g < 0``, in one pass without temporaries."""
    for i in range(g.size):
        x = np.float64(g[i])
        v = abs(x) / norm
        u[i] = 1.0 if v > 1.0 else v
        neg[i] = x < 0.0


@njit(cache=True, nogil=True)
def _entropies(acc, svals, offs, n, out):  # pragma: no cover - compiled
    """out[k] = −Σ_ℓ p_ℓ·log2 p_ℓ over the signed levels of width k (p = expected count / n)."""
    scale = 1.0 / (np.float64(n) * np.float64(_ONE))
    for k in range(svals.size):
        s = svals[k]
        h = 0.0
        for side in range(2):
            base = 2 * (offs[k] + (s + 1) * side)
            carry = np.int64(0)  # F of the level below, on this side
            for level in range(s + 1):
                mass = acc[base + 2 * level] * _ONE - acc[base + 2 * level + 1] + carry
                carry = acc[base + 2 * level + 1]
                if level == 0:
                    if side == 0:
                        continue  # level 0 takes both sides' C_0 − F_0: added with the negative side's
                    mass += acc[2 * offs[k]] * _ONE - acc[2 * offs[k] + 1]
                if mass > 0:
                    p = np.float64(mass) * scale
                    h -= p * np.log2(p)
        out[k] = h


def value_level_entropies(g: np.ndarray, norm: float, levels: list[int]) -> list[float]:
    """:func:`expected_level_entropies` of the values ``g`` (1-D float32 or float64) at scale ``norm`` > 0:
    u = min(|g|/norm, 1) in float64 and the signs of g, computed in the kernel (the same floats)."""
    if g.ndim != 1 or g.dtype not in (np.float32, np.float64):
        raise ValueError(f"value_level_entropies needs 1-D float32 or float64 values, got {g.dtype} {g.shape}")
    if not norm > 0:
        raise ValueError(f"value_level_entropies needs a scale > 0, got {norm!r}")
    u, neg = np.empty(g.size, dtype=np.float64), np.empty(g.size, dtype=np.bool_)
    _magnitudes(np.ascontiguousarray(g), np.float64(norm), u, neg)
    return expected_level_entropies(u, neg, levels)


def expected_level_entropies(u: np.ndarray, neg: np.ndarray, levels: list[int]) -> list[float]:
    """Entropy, bits per coordinate, of stochastic rounding's signed levels at each ``s`` of ``levels``.

    ``u``: float64 magnitudes in [0, 1] (|x| / scale, clamped); ``neg``: bool, True where the coordinate
    is negative. An empty ``u`` has entropy 0 at every width."""
    if u.dtype != np.float64 or neg.dtype != np.bool_ or u.shape != neg.shape or u.ndim != 1:
        raise ValueError(f"expected_level_entropies needs 1-D float64 u and bool neg of one shape, got {u.dtype} "
                         f"{u.shape} and {neg.dtype} {neg.shape}")
    svals = np.asarray(levels, dtype=np.int64)
    if svals.size and svals.min() < 1:
        raise ValueError(f"expected_level_entropies needs s ≥ 1 levels, got {levels}")
    if u.size and not (u.min() >= 0.0 and u.max() <= 1.0):
        raise ValueError("expected_level_entropies needs magnitudes u in [0, 1]")
    if u.size == 0:
        return [0.0] * svals.size
    offs = np.zeros(svals.size, dtype=np.int64)
    np.cumsum(2 * (svals[:-1] + 1), out=offs[1:])
    acc = np.zeros(2 * int((2 * (svals + 1)).sum()), dtype=np.int64)
    _bins(np.ascontiguousarray(u), np.ascontiguousarray(neg), svals, offs, acc)
    out = np.zeros(svals.size, dtype=np.float64)
    _entropies(acc, svals, offs, u.size, out)
    return out.tolist()
