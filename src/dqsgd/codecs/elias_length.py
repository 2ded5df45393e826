"""ELIAS's length counted fast, for AUTO's choice: exactly without a branch on the codes, and bounded
from below in one vectorised pass (:mod:`dqsgd.codecs.elias` has the format and the reference count).

A gradient's zero/non-zero pattern is random, so a loop that branches on it (as the encoder must) is
mispredicted about every other code where half the codes are zero; these loops do not branch on it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from dqsgd.codecs.elias import OMEGA_LENGTHS, elias_bit_length, omega_length, omega_word
from dqsgd.codecs.threads import run_split, split

__all__ = ["gap_bits_floor", "valid_codes_bit_length"]


@njit(cache=True, nogil=True)
def _length_range(codes, lengths, lo, hi):  # pragma: no cover - compiled
    """Elias bits of the non-zero codes in ``[lo, hi)`` but for the first one's gap word (which depends
    on the range before): (bits, index of the first non-zero, of the last, count, flag, lo, hi); the
    indices −1 if there is none.

    Branch-free on the codes (the zero/non-zero pattern of a gradient is random: a branch on it is
    mispredicted every other code, 3-4x slower): the table of ``2^k`` lengths is indexed by the gap
    and magnitude modulo ``2^k``, which is their length unless one of them is ``≥ 2^k``; ``flag`` is
    the OR of the non-zero codes' gaps and magnitudes, so ``flag ≥ 2^k`` says the bits are not exact."""
    mask = lengths.size - 1
    first = lo
    while first < hi and codes[first] == 0:
        first += 1
    if first == hi:
        return np.int64(0), np.int64(-1), np.int64(-1), np.int64(0), np.int64(0), lo, hi
    m0 = abs(np.int64(codes[first]))
    bits = np.int64(1) + (lengths[m0] if m0 <= mask else omega_word(m0)[1])
    nnz = np.int64(1)
    prev = np.int64(first + 1)
    flag = np.int64(0)
    for i in range(first + 1, hi):
        m = abs(np.int64(codes[i]))
        nz = -np.int64(m != 0)  # all ones for a non-zero code
        g = i + 1 - prev
        bits += (lengths[g & mask] + 1 + lengths[m & mask]) & nz
        flag |= (g | m) & nz
        nnz -= nz
        prev += g & nz
    return bits, first, prev - 1, nnz, flag, lo, hi


@njit(cache=True, nogil=True)
def _gap_floor_range(codes, lo, hi):  # pragma: no cover - compiled
    """Σ over the non-zero codes i in ``[lo, hi)`` of 2·[gap ≥ 2] + 3·[gap ≥ 4] + [gap ≥ 8], read from the
    7 codes before each (gap ≥ k ⟺ the k − 1 codes before i exist and are 0). No loop-carried state:
    the main loop reads eight shifted views and vectorises (7x faster than counting the gaps)."""
    total = np.int64(0)
    start = min(max(lo, 7), hi)
    for i in range(lo, start):  # the first 7 codes of the array: fewer than 7 before them
        if codes[i] != 0:
            run = 0
            while run < 7 and i - run - 1 >= 0 and codes[i - run - 1] == 0:
                run += 1
            total += 2 * (run >= 1) + 3 * (run >= 3) + (run >= 7)
    block = 1 << 24  # an int32 sum of at most 6 per code cannot overflow within a block
    for b0 in range(start, hi, block):
        b1 = min(b0 + block, hi)
        c0, c1, c2, c3 = codes[b0:b1], codes[b0 - 1 : b1 - 1], codes[b0 - 2 : b1 - 2], codes[b0 - 3 : b1 - 3]
        c4, c5, c6, c7 = codes[b0 - 4 : b1 - 4], codes[b0 - 5 : b1 - 5], codes[b0 - 6 : b1 - 6], codes[b0 - 7 : b1 - 7]
        t = np.int32(0)
        for i in range(b1 - b0):
            nz = np.int32(c0[i] != 0)
            z1 = np.int32(c1[i] == 0)
            z3 = z1 & np.int32(c2[i] == 0) & np.int32(c3[i] == 0)
            z7 = z3 & np.int32(c4[i] == 0) & np.int32(c5[i] == 0) & np.int32(c6[i] == 0) & np.int32(c7[i] == 0)
            t += -nz & (2 * z1 + 3 * z3 + z7)
        total += t
    return total


def gap_bits_floor(codes: np.ndarray) -> int:
    """A lower bound on Σ over the non-zero codes of ``L(gap) − 1`` (their gap words' bits beyond one):
    ``L(g) ≥ 1 + 2·[g ≥ 2] + 3·[g ≥ 4] + [g ≥ 8]`` (L(2) = 3, L(4) = 6, L(8) = 7), counted from the codes
    before each non-zero one, on several threads. With the histogram's ``Σ (2 + L(|c|))`` it bounds
    ELIAS's length from below far closer than the histogram alone (which must allow every gap to be 1)."""
    return int(sum(run_split(_gap_floor_range, codes.size, codes, min_per_thread=1 << 18)))


def valid_codes_bit_length(codes: np.ndarray, *, stop_above: int | None = None, threads: int | None = None,
                           min_per_thread: int = 1 << 18) -> int:
    """:func:`~dqsgd.codecs.elias.elias_bit_length` of codes already known valid (int32: the wire's
    integer codes), counted branch-free in contiguous ranges (:func:`_length_range`): the same number.
    A range whose gaps or magnitudes reach past the table (``flag``) is counted again exactly, by
    :func:`~dqsgd.codecs.elias.elias_bit_length`.

    Without ``stop_above`` the ranges run on several threads (:func:`~dqsgd.codecs.threads.run_split`);
    with it, one after the other (ranges of ``min_per_thread`` codes) until the length passes
    ``stop_above``: then some value greater than it is returned, as
    :func:`~dqsgd.codecs.elias.elias_bit_length` does."""
    n = codes.size
    if stop_above is None:
        parts = run_split(_length_range, n, codes, OMEGA_LENGTHS, min_per_thread=min_per_thread, threads=threads)
    else:
        parts = (_length_range(codes, OMEGA_LENGTHS, lo, hi) for lo, hi in split(n, -(-n // min_per_thread)))
    bits, nnz, prev = 0, 0, 0
    for b, first, last, k, flag, lo, hi in parts:
        if k and flag >= OMEGA_LENGTHS.size:
            nz = np.flatnonzero(codes[lo:hi])
            scan = elias_bit_length(codes[lo:hi])
            b = scan - omega_length(int(k) + 1) - omega_length(int(nz[0]) + 1)
        if k:
            bits += int(b) + omega_length(int(first) + 1 - prev)
            nnz, prev = nnz + int(k), int(last) + 1
        if stop_above is not None and bits > stop_above:
            return bits
    return bits + omega_length(nnz + 1)
