"""Compiled loops over quantization levels that the policies need every step.

:func:`rounding_histogram` — the expected histogram of the signed levels of unbiased stochastic
rounding at ``s`` levels: coordinate ``i`` (magnitude ``u_i ∈ [0, 1]`` of the scale) lands on level
``⌊u_i·s⌋`` with probability ``1 − frac_i`` and on ``min(⌊u_i·s⌋ + 1, s)`` with probability ``frac_i``
(``frac_i = u_i·s − ⌊u_i·s⌋``), with its sign. Bin ``s + level`` (levels −s … s) holds the summed
probabilities.

It is ``torch.bincount(cat([s + sign·low, s + sign·high]), weights=cat([1 − frac, frac]))`` bit for bit:
the same float64 operations, added in the same order (every ``1 − frac`` first, then every ``frac``,
each in coordinate order, as ``bincount`` adds its inputs), without the four temporaries of 2n
elements that made it the slowest part of a ``dqsgd-coded`` step.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["rounding_histogram"]


@njit(cache=True, nogil=True)
def _histogram(u, neg, s, out):  # pragma: no cover - compiled
    sf = np.float64(s)
    for half in range(2):  # pass 0 adds the 1 − frac of the lower levels, pass 1 the frac of the upper ones
        for i in range(u.size):
            v = u[i] * sf
            low = np.floor(v)
            frac = v - low
            level = np.int64(low) + half
            if level > s:
                level = s
            w = frac if half else 1.0 - frac
            out[s - level if neg[i] else s + level] += w


def rounding_histogram(u: np.ndarray, neg: np.ndarray, s: int) -> np.ndarray:
    """float64 bins ``0 … 2s`` (bin ``s + level``) of the expected level counts; ``u``: float64 magnitudes
    in [0, 1], ``neg``: bool, True where the coordinate is negative."""
    if u.dtype != np.float64 or neg.dtype != np.bool_ or u.shape != neg.shape or u.ndim != 1:
        raise ValueError(f"rounding_histogram needs 1-D float64 u and bool neg of one shape, got {u.dtype} "
                         f"{u.shape} and {neg.dtype} {neg.shape}")
    if s < 1:
        raise ValueError(f"rounding_histogram needs s ≥ 1 levels, got {s}")
    out = np.zeros(2 * s + 1, dtype=np.float64)
    _histogram(np.ascontiguousarray(u), np.ascontiguousarray(neg), np.int64(s), out)
    return out
