"""Which codes a payload may carry: the range of a (scheme, bits, levels), checked on encode and decode.

Width b = 1 allows {−1, +1}, b ≥ 2 allows [−2^(b−1), 2^(b−1) − 1]; within that UNIFORM needs
|c| ≤ levels, SIGN c ∈ {−1, +1}, TERNARY c ∈ {−1, 0, +1}, LOWPREC any (:mod:`dqsgd.codecs.wire`).
The check reads the codes (:func:`range_error`, one compiled pass) or, where the encoder's caller
counted them already, their level histogram (:func:`histogram_range_error`, no pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from dqsgd.codecs.header import U32_MAX
from dqsgd.quantizers.base import RAW_SCHEMES, Scheme

__all__ = ["MAX_CODE_BITS", "code_range", "histogram_range_error", "range_error", "scheme_error", "top_code"]

MAX_CODE_BITS = 16


@dataclass(frozen=True)
class _Range:
    """The valid codes of a (scheme, bits, levels): ``lo ≤ c ≤ hi``, and 0 only if ``zero_ok``."""

    lo: int
    hi: int
    zero_ok: bool


def code_range(scheme: Scheme, bits: int, levels: int) -> _Range:
    lo, hi, zero_ok = (-1, 1, False) if bits == 1 else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1, True)
    if scheme == Scheme.UNIFORM:
        lo, hi = max(lo, -levels), min(hi, levels)
    elif scheme in (Scheme.SIGN, Scheme.TERNARY):
        lo, hi = max(lo, -1), min(hi, 1)
        zero_ok = zero_ok and scheme == Scheme.TERNARY
    return _Range(lo, hi, zero_ok)


def top_code(scheme: Scheme, bits: int, levels: int) -> int:
    """The largest |c| a (scheme, bits, levels) allows: where the finite-output rule bounds a
    payload's values from its scales (:func:`dqsgd.quantizers.finite.step_bound`)."""
    rng = code_range(scheme, bits, levels)
    return max(-rng.lo, rng.hi)


def scheme_error(scheme: Scheme, bits: int, levels: int) -> str | None:
    """Why (scheme, bits, levels) is not allowed, or None."""
    if scheme in RAW_SCHEMES:
        return None if bits == 32 else f"{scheme.name} needs bits = 32, got {bits}"
    if not 1 <= bits <= MAX_CODE_BITS:
        return f"{scheme.name} needs bits in 1..{MAX_CODE_BITS}, got {bits}"
    if not 1 <= levels <= U32_MAX:
        return f"{scheme.name} needs levels in 1..2^32-1, got {levels}"
    return None


@njit(cache=True)
def _stats(codes):  # pragma: no cover - compiled
    """(min, max, number of zeros) in one pass."""
    lo = np.int64(0)
    hi = np.int64(0)
    zeros = 0
    if codes.size:
        lo = hi = np.int64(codes[0])
    for i in range(codes.size):
        c = np.int64(codes[i])
        lo = min(lo, c)
        hi = max(hi, c)
        zeros += c == 0
    return lo, hi, zeros


def range_error(codes: np.ndarray, rng: _Range) -> str | None:
    lo, hi, zeros = _stats(codes)
    if codes.size and (lo < rng.lo or hi > rng.hi):
        return f"codes span [{lo}, {hi}], the scheme allows [{rng.lo}, {rng.hi}]"
    if zeros and not rng.zero_ok:
        return f"{zeros} zero codes, which this scheme and width cannot carry"
    return None


def histogram_range_error(hist: np.ndarray, numel: int, bits: int, rng: _Range) -> str | None:
    """:func:`range_error` of codes whose :func:`~dqsgd.codecs.rans.level_histogram` is ``hist``
    (O(2^bits), no pass over the codes); a ``hist`` that cannot be one of ``numel`` codes is refused."""
    if hist.shape != (1 << bits,) or int(hist.sum()) != numel or (hist < 0).any():
        raise ValueError(f"histogram of shape {hist.shape} summing to {int(hist.sum())}: not the level histogram of "
                         f"{numel} codes at {bits} bits")
    present = np.flatnonzero(hist)
    if not present.size:
        return None
    offset = 0 if bits == 1 else 1 << (bits - 1)
    lo, hi = ((-1 if present[0] == 0 else 1), (1 if present[-1] == 1 else -1)) if bits == 1 else \
        (int(present[0]) - offset, int(present[-1]) - offset)
    if lo < rng.lo or hi > rng.hi:
        return f"codes span [{lo}, {hi}], the scheme allows [{rng.lo}, {rng.hi}]"
    zeros = 0 if bits == 1 else int(hist[offset])
    if zeros and not rng.zero_ok:
        return f"{zeros} zero codes, which this scheme and width cannot carry"
    return None
