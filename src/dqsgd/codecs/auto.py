"""``Coding.AUTO``: the smallest body of FIXED, ELIAS, ZSTD_ALIGNED and rANS, found without coding them all.

The rANS candidate is RANSX (8 interleaved states: about 2x faster to decode, up to 60 bytes more
state) for :data:`RANSX_MIN_CODES` codes or more, and RANS below: a rule on ``n`` alone, so AUTO stays
a function of the codes. Each candidate's size is known, or bounded, from the levels' histogram (one
compiled pass) before any body is built:

* FIXED: exactly ``⌈n·b/8⌉`` bytes.
* ELIAS: at least ``L(nnz+1) + Σ_(c≠0) [2 + L(|c|)]`` bits from the histogram (every gap's ω word
  has ≥ 1 bit); by size (no link rate), when that does not settle it, also at least the gap words'
  bits from the codes before each non-zero one (:func:`~dqsgd.codecs.elias_length.gap_bits_floor`: one
  vectorised pass, 7x cheaper than the exact count); only when neither bound settles it, exactly
  ``L(nnz+1) + Σ_(c≠0) [L(gap) + 1 + L(|c|)]`` bits from a second pass, stopped as soon as ELIAS is
  sure to lose (:func:`_elias_bits`). A bound that settles it (ELIAS above the best so far, or above
  what rANS is sure to reach) leaves the choice as the exact length would: with ELIAS above rANS's
  largest size, rANS is chosen over ELIAS and over whatever ELIAS would have displaced.
* RANS: the table exactly, the stream within about ±1.1 % of a bit per code
  (:func:`~dqsgd.codecs.rans.rans_size_bounds`); RANSX within a few bytes
  (:func:`~dqsgd.codecs.ransx.ransx_size_bounds`). Encoded (once, the histogram reused) only if
  the lower bound can beat the best exact size so far.
* ZSTD_ALIGNED: zstd exploits repeats (runs of zeros, the period of a layer whose inputs are
  always zero), which no histogram sees. A body of at most :data:`ZSTD_EXACT_BYTES` is compressed
  whole; a bigger one first compresses :data:`ZSTD_SAMPLES` evenly spaced blocks of
  :data:`ZSTD_BLOCK` bytes, and the whole body only when that sample, scaled to the body, is within
  :data:`ZSTD_SLACK` of the best size so far.

So AUTO is exactly the smallest of the four (ties: FIXED, ELIAS, ZSTD_ALIGNED, rANS in that order)
whenever zstd's size is known: bodies up to ``ZSTD_EXACT_BYTES``, and bigger ones whose sample is
close enough; otherwise the smallest of FIXED, ELIAS and RANS. On 770 MLP and LeNet-5 gradients
(MNIST, SGD steps 0-300, 2-8 bits, whole and in 4 shards) rANS was the smallest 60 % of the time,
zstd 37 % (nearly all at ≥ 4 bits, where the always-zero inputs of the first layer repeat), Elias
4 %, FIXED never; AUTO picked the smallest every time, and compressed the whole body with zstd in
about half of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from dqsgd.codecs.bitpack import packed_size
from dqsgd.codecs.bodies import fixed_body, zstd_compress
from dqsgd.codecs.bounds import body_width
from dqsgd.codecs.elias import OMEGA_LENGTHS, MAX_OMEGA, elias_bit_length, elias_encode, omega_word
from dqsgd.codecs.elias_length import gap_bits_floor, valid_codes_bit_length
from dqsgd.codecs.header import Coding
from dqsgd.codecs.rans import level_histogram, rans_encode, rans_size_bounds
from dqsgd.codecs.ransx import ransx_encode, ransx_size_bounds

__all__ = ["CPU_NS", "RANSX_MIN_CODES", "ZSTD_BLOCK", "ZSTD_EXACT_BYTES", "ZSTD_SAMPLES", "ZSTD_SLACK", "level_stats",
           "rans_candidate", "smallest_body"]

ZSTD_EXACT_BYTES = 1 << 16  # aligned bodies up to 64 KiB: zstd runs on all of it
ZSTD_BLOCK = 1 << 12
ZSTD_SAMPLES = 8  # 32 KiB sampled from a bigger body
ZSTD_SLACK = 0.1  # the whole body is compressed when the sample's estimate ≤ 1.1 × the best size so far
RANSX_MIN_CODES = 1 << 16  # from here on RANSX's ≤ 60 extra state bytes are < 0.1 % of a 1-bit-per-code body
_ORDER = (Coding.FIXED, Coding.ELIAS, Coding.ZSTD_ALIGNED, Coding.RANS, Coding.RANSX)  # the tie order
_RANS = {Coding.RANS: (rans_encode, rans_size_bounds), Coding.RANSX: (ransx_encode, ransx_size_bounds)}



@njit(cache=True, nogil=True)
def _level_stats(codes, offset, one_bit, nsym, lengths):  # pragma: no cover - compiled
    """(histogram of the offset-binary symbols, ELIAS stream bits before padding) in one pass: the
    Elias length is ``L(nnz+1) + Σ_(c≠0) [L(gap) + 1 + L(|c|)]`` (:mod:`dqsgd.codecs.elias`), the
    histogram four partial counts (consecutive codes are mostly the same level)."""
    part = np.zeros((4, nsym), np.int64)
    length = np.int64(0)
    nnz = np.int64(0)
    prev = np.int64(0)
    for i in range(codes.size):
        c = np.int64(codes[i])
        part[i & 3, np.int64(c > 0) if one_bit else c + offset] += 1
        if c != 0:
            g = i + 1 - prev
            m = abs(c)
            length += (lengths[g] if g < lengths.size else omega_word(g)[1]) + 1
            length += lengths[m] if m < lengths.size else omega_word(m)[1]
            prev = i + 1
            nnz += 1
    hist = part[0].copy()
    for k in range(1, 4):
        hist += part[k]
    return hist, length + omega_word(nnz + 1)[1]


def level_stats(codes: np.ndarray, bits: int) -> tuple[np.ndarray, int]:
    """(:func:`~dqsgd.codecs.rans.level_histogram`, the exact ELIAS body bytes) of valid codes, one pass."""
    hist, length = _level_stats(codes, 0 if bits == 1 else 1 << (bits - 1), bits == 1, 1 << bits, OMEGA_LENGTHS)
    return hist, (int(length) + 7) // 8


def _zstd_may_win(data: np.ndarray, bits: int, best: int) -> bool:
    """Whether ZSTD_ALIGNED may beat ``best`` bytes: always for a small body, else by a sample."""

    width = body_width(bits, Coding.ZSTD_ALIGNED)
    size = packed_size(data.size, width)
    if size <= ZSTD_EXACT_BYTES:
        return True
    per = 8 * ZSTD_BLOCK // width  # codes per sampled block (a multiple of 8: whole bytes)
    starts = np.linspace(0, data.size - per, ZSTD_SAMPLES).astype(np.int64)
    sample = sum(len(zstd_compress(fixed_body(data[a : a + per], bits, width))) for a in starts.tolist())
    return sample * size / (ZSTD_SAMPLES * ZSTD_BLOCK) <= (1 + ZSTD_SLACK) * best


def rans_candidate(n: int) -> Coding:
    """AUTO's rANS coding for ``n`` codes: RANSX from :data:`RANSX_MIN_CODES` on, else RANS."""
    return Coding.RANSX if n >= RANSX_MIN_CODES else Coding.RANS


def _elias_lower_bound(hist: np.ndarray, bits: int, gap_floor: int = 0) -> int:
    """Bytes an ELIAS body of codes with histogram ``hist`` takes at least: each non-zero code c costs
    ``L(gap) + 1 + L(|c|) ≥ 2 + L(|c|)`` bits, and the count word ``L(nnz+1)``; ``gap_floor``: a lower
    bound on the gap words' bits beyond one each (:func:`~dqsgd.codecs.elias_length.gap_bits_floor`)."""
    u = np.arange(hist.size, dtype=np.int64)
    mag = np.abs(2 * u - 1) if bits == 1 else np.abs(u - (1 << (bits - 1)))
    nz = (mag > 0) & (hist > 0)
    nnz = int(hist[nz].sum())
    m = mag[nz]
    lengths = (OMEGA_LENGTHS[m] if m.size == 0 or m.max() < OMEGA_LENGTHS.size
               else np.array([omega_word(np.int64(v))[1] for v in m.tolist()], dtype=np.int64))
    length = int((hist[nz] * (2 + lengths)).sum()) + int(omega_word(np.int64(nnz + 1))[1]) + gap_floor
    return (length + 7) // 8


def _elias_stop(costs: _Costs, best: tuple[int, Coding], rans_hi: int) -> int:
    """Bits past which ELIAS cannot be AUTO's choice: it loses to ``best``, or (by size) to rANS,
    whose body has at most ``rans_hi`` bytes (rANS then wins whatever else ELIAS would have displaced:
    every other candidate is compared with the same best either way)."""
    top = costs.max_bytes(Coding.ELIAS, best)
    return 8 * (top if costs.link_mbit else min(top, rans_hi))


def _elias_bits(data: np.ndarray, hist: np.ndarray, bits: int, stop: int) -> int:
    """ELIAS's exact stream bits of valid codes, or some number > ``stop`` once it is sure to pass it.
    Between 25 % and 80 % non-zero codes the zero/non-zero pattern defeats a branch on it: there the
    branch-free count (:func:`~dqsgd.codecs.elias_length.valid_codes_bit_length`, 1.5x less CPU time at half
    non-zero, 3.2M Gaussian codes), elsewhere the scan that branches on it; both stop early."""
    zeros = int(hist[1 << (bits - 1)]) if bits > 1 else 0
    if 0.25 < 1 - zeros / data.size < 0.8:
        return valid_codes_bit_length(data, stop_above=stop)
    return elias_bit_length(data, stop_above=stop)


# Modelled CPU cost, ns per code, of encoding and decoding with each coding (the fused kernels for
# FIXED): thread CPU time on a 1M-coordinate Gaussian at 2-6 bits, 2-core AMD EPYC shared with other
# jobs, 2026-11-25 (RANSX: 2026-11-26, `benchmarks/bench_codec.py --rans`; the script is in the docs).
# Only used with a link rate.
CPU_NS = {Coding.FIXED: 2.5, Coding.ELIAS: 20.0, Coding.ZSTD_ALIGNED: 7.5, Coding.RANS: 17.0, Coding.RANSX: 11.0}


@dataclass(frozen=True)
class _Costs:
    """How candidates compare: by size (ties: the tie order), or with ``link_mbit`` > 0 by the modelled
    time ``CPU_NS[c]·n + 8·size / link`` (a byte takes 8000/link_mbit ns on the wire)."""

    n: int
    link_mbit: float

    def key(self, size: int, coding: Coding) -> tuple[float, int]:
        t = size if not self.link_mbit else CPU_NS[coding] * self.n + 8000.0 * size / self.link_mbit
        return (t, _ORDER.index(coding))

    def max_bytes(self, coding: Coding, best: tuple[int, Coding]) -> int:
        """The largest size at which ``coding`` beats ``best`` (−1: none does)."""
        if not self.link_mbit:
            return best[0] - (0 if _ORDER.index(coding) < _ORDER.index(best[1]) else 1)
        size = math.floor((self.key(*best)[0] - CPU_NS[coding] * self.n) * self.link_mbit / 8000.0)
        while size >= 0 and not self.key(size, coding) < self.key(*best):  # a float rounding at the edge
            size -= 1
        return max(size, -1)


def smallest_body(data: np.ndarray, bits: int, integer: bool, link_mbit: float = 0.0,
                  hist: np.ndarray | None = None) -> tuple[Coding, bytes | np.ndarray]:
    """AUTO's (coding, body) for valid codes ``data`` (int32; raw float32 values when not ``integer``:
    only FIXED and ZSTD_ALIGNED apply). See the module docstring; ``link_mbit`` > 0: the fastest at that
    link rate by the CPU_NS model, instead of the smallest; ``hist``: the codes' level histogram, where
    the caller has it."""

    costs = _Costs(data.size, link_mbit)
    best: tuple[int, Coding] = (packed_size(data.size, bits), Coding.FIXED)
    bodies: dict[Coding, bytes | np.ndarray] = {}
    rans = rans_candidate(data.size)
    encode_rans, rans_bounds = _RANS[rans]
    if integer and data.size:
        hist = level_histogram(data, bits) if hist is None else hist
        rans_lo, rans_hi = rans_bounds(hist)
        # ELIAS's exact length takes a second pass: only where its lower bound beats both the best so far
        # and what rANS is sure to reach (then rANS, not ELIAS, would be the smallest).
        def open_(lo: int) -> bool:  # a lower bound of ELIAS's bytes that leaves it a chance
            return data.size < MAX_OMEGA and lo < costs.key(*best) and not lo > costs.key(rans_hi, rans)

        elias_lo = costs.key(_elias_lower_bound(hist, bits), Coding.ELIAS)
        if open_(elias_lo) and not link_mbit:  # by size: a closer bound from one vectorised pass often settles it
            elias_lo = costs.key(_elias_lower_bound(hist, bits, gap_bits_floor(data)), Coding.ELIAS)
        if open_(elias_lo):
            elias = (_elias_bits(data, hist, bits, _elias_stop(costs, best, rans_hi)) + 7) // 8
            if costs.key(elias, Coding.ELIAS) < costs.key(*best):
                best = (elias, Coding.ELIAS)
    else:
        hist, rans_lo, rans_hi = None, 0, 0
    cap = costs.max_bytes(Coding.ZSTD_ALIGNED, best)
    if hist is not None and not link_mbit:
        cap = min(cap, rans_hi)
    if cap >= 0 and _zstd_may_win(data, bits, cap):
        z = zstd_compress(fixed_body(data, bits, body_width(bits, Coding.ZSTD_ALIGNED)))
        if costs.key(len(z), Coding.ZSTD_ALIGNED) < costs.key(*best):
            best, bodies[Coding.ZSTD_ALIGNED] = (len(z), Coding.ZSTD_ALIGNED), z
    if hist is not None and costs.key(rans_lo, rans) < costs.key(*best):
        r = encode_rans(data, bits, hist)
        if costs.key(r.size, rans) < costs.key(*best):
            best, bodies[rans] = (r.size, rans), r
    coding = best[1]
    if coding not in bodies:
        bodies[coding] = elias_encode(data) if coding == Coding.ELIAS else fixed_body(data, bits, bits)
    return coding, bodies[coding]
