"""Interleaved 64-bit rANS of the quantization levels: ``Coding.RANSX``.

The same symbols and the same frequency table as ``Coding.RANS`` (:mod:`dqsgd.codecs.rans`: offset
binary ``u``, frequencies :func:`~dqsgd.codecs.rans.normalize` of the counts, ``M = 2^16``), coded by
``LANES = 8`` independent rANS states: code ``i`` belongs to lane ``i mod 8``.  A body of ``n``
codes is (n = 0: the empty body)::

    table                            exactly as in RANS (varint K, K × (varint gap, varint freq))
    8 × u64 state                    each lane's final encoder state x_j, little-endian, L ≤ x_j < 2^32·L
    stream words                     u32 little-endian renormalisation words, in the order the decoder reads them

Each state has 64 bits, ``L = 2^31``, state in ``[L, 2^63)``, and renormalises by 32-bit words
(ryg's rans64 with Giesen's interleaving): the lanes' chains of state updates are independent, so
the CPU overlaps them, and a symbol moves at most one word, so the loop has one rarely taken branch.
Encoding runs over the codes backwards from ``x_j = L``: before coding ``u`` (frequency ``f``,
cumulative ``c``) in lane ``j = i mod 8``, if ``x_j ≥ 2^47·f`` emit the word ``x_j mod 2^32`` and
``x_j >>= 32``; then ``x_j ← ⌊x_j/f⌋·M + (x_j mod f) + c``.  Decoding runs forwards: ``slot = x_j mod M``,
the symbol whose ``[c, c+f)`` holds ``slot``, ``x_j ← f·⌊x_j/M⌋ + slot − c``, and if ``x_j < L`` read
a word, ``x_j ← 2^32·x_j + word``.  After ``n`` codes every lane must be back at ``L`` with every word read.

The quotient ``⌊x/f⌋`` (``x < 2^47·f``, so below 2^47) is computed from the float64 product
``x·(1/f)``, within 1 of it, and corrected by the remainder: exact, and no division instruction.

Size: a state ``x ≥ 2^15·f`` when it is coded (``L/M = 2^15``), so each code moves ``log2 x`` by
``log2(M/f)`` within ``log2(1 ± 2^-15)``: the stream is ``Σ log2(M/f_u)`` bits within ``±4.4·10^-5``
bit per code, and the lanes' final states take what they hold in 8 bytes each, so
:func:`ransx_size_bounds` is within a few bytes of the actual size.  Decoding is strict and bounded
like RANS's: every field and word is checked against the end of the body before it is read, and a
decoded body re-encodes to the same bytes.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from numba import njit

from dqsgd.codecs.rans import (M, PROB_BITS, STATUS_FINAL, STATUS_MESSAGES, STATUS_OK, STATUS_STATE, STATUS_TRAILING,
                               STATUS_TRUNC_STREAM, RansError, check_counts, decode_buffers, level_histogram,
                               normalize, read_table, table_len, write_table)

__all__ = ["LANES", "RANSX_L", "ransx_decode", "ransx_decode_uncounted", "ransx_encode", "ransx_size_bounds"]

LANES = 8  # a power of two
RANSX_L = 1 << 31  # lower bound of a normalised state; the upper bound is 2^32·L = 2^63
_XMAX_UNIT = (RANSX_L >> PROB_BITS) << 32  # a lane emits a word when x ≥ 2^47·f
_WORD = 4
_STATE_BYTES = 8
_PRECISION = 2.0 ** -15  # f/x when a state is coded


def _encoder_tables(symbols: np.ndarray, freq: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per symbol u (a row of 2^b): int64 (x_max, f, c) and float64 1/f (rows of absent symbols unused)."""
    ints = np.zeros((1 << bits, 3), dtype=np.int64)
    inv = np.ones(1 << bits, dtype=np.float64)
    cum = np.concatenate(([0], np.cumsum(freq)[:-1]))
    ints[symbols] = np.stack([_XMAX_UNIT * freq, freq, cum], axis=1)
    inv[symbols] = 1.0 / freq
    return ints, inv


@njit(cache=True, inline="always")
def _enc_step(x, u, ints, inv, words, pw):  # pragma: no cover - compiled
    """One lane's step on symbol ``u``: (the new state, the new first word used). The word is stored
    every step and kept (the position moves) only when the lane renormalises: no branch to mispredict."""
    emit = np.int64(x >= ints[u, 0])  # at most one word: x < 2^63, and x_max = 2^47·f > 2^31 after it
    words[pw - 1] = np.uint32(x & 0xFFFFFFFF)
    pw -= emit
    x >>= 32 * emit
    f = ints[u, 1]
    q = np.int64(np.float64(x) * inv[u])  # ⌊x/f⌋ or one off: x/f < 2^47, the float error < 2^-4
    r = x - q * f
    if r < 0:
        q -= 1
        r += f
    elif r >= f:
        q += 1
        r -= f
    return (q << PROB_BITS) + r + ints[u, 2], pw


@njit(cache=True, inline="always")
def _symbol(c, offset, one_bit):  # pragma: no cover - compiled
    return np.int64(c > 0) if one_bit else np.int64(c) + offset


@njit(cache=True, nogil=True)
def _encode(codes, offset, one_bit, ints, inv, words, xs):  # pragma: no cover - compiled
    """Encode ``codes`` backwards into the tail of ``words`` (K ≥ 2) and the lanes' final states into
    ``xs``; the first word used, or −1 if full.

    Codes i = n−1 … 0 in that order, code i in lane i mod 8: the codes past the last whole group of
    8 one at a time, then whole groups (lanes 7 … 0) with the eight states in locals, where the
    compiler keeps them in registers and overlaps the lanes' independent chains (1.3x, measured),
    while 8 words are left; then the rest one at a time. The same steps in the same order as one
    loop over i: the same words and states."""
    pw = np.int64(words.size)
    groups = codes.size // LANES
    for i in range(codes.size - 1, groups * LANES - 1, -1):
        if pw < 1:
            return -1
        xs[i & (LANES - 1)], pw = _enc_step(xs[i & (LANES - 1)], _symbol(codes[i], offset, one_bit), ints, inv,
                                            words, pw)
    x0, x1, x2, x3, x4, x5, x6, x7 = xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7]
    g = groups - 1
    while g >= 0 and pw >= LANES:
        c = codes[g * LANES : g * LANES + LANES]
        x7, pw = _enc_step(x7, _symbol(c[7], offset, one_bit), ints, inv, words, pw)
        x6, pw = _enc_step(x6, _symbol(c[6], offset, one_bit), ints, inv, words, pw)
        x5, pw = _enc_step(x5, _symbol(c[5], offset, one_bit), ints, inv, words, pw)
        x4, pw = _enc_step(x4, _symbol(c[4], offset, one_bit), ints, inv, words, pw)
        x3, pw = _enc_step(x3, _symbol(c[3], offset, one_bit), ints, inv, words, pw)
        x2, pw = _enc_step(x2, _symbol(c[2], offset, one_bit), ints, inv, words, pw)
        x1, pw = _enc_step(x1, _symbol(c[1], offset, one_bit), ints, inv, words, pw)
        x0, pw = _enc_step(x0, _symbol(c[0], offset, one_bit), ints, inv, words, pw)
        g -= 1
    xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7] = x0, x1, x2, x3, x4, x5, x6, x7
    for i in range(g * LANES + LANES - 1, -1, -1):  # only when fewer than 8 words were left
        if pw < 1:
            return -1
        xs[i & (LANES - 1)], pw = _enc_step(xs[i & (LANES - 1)], _symbol(codes[i], offset, one_bit), ints, inv,
                                            words, pw)
    return pw


def _stream_info(hist: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    symbols = np.flatnonzero(hist).astype(np.int64)
    counts = hist[symbols]
    freq = normalize(counts)
    return symbols, counts, freq, float((counts * (PROB_BITS - np.log2(freq))).sum())


def ransx_size_bounds(hist: np.ndarray) -> tuple[int, int]:
    """(lo, hi) with lo ≤ len(ransx_encode(codes, bits)) ≤ hi for any codes whose histogram is ``hist``.

    With ``I = Σ_u count_u·log2(M/f_u)`` the lanes' states and words hold ``I`` bits within
    ``n·log2(1 ± 2^-15)`` more (module docstring); each final state holds between 0 and 32 of those
    bits above ``log2 L``, so the stream has between ``(I − δ − 32·LANES)/32`` and ``(I + δ)/32`` words.
    One symbol: no stream, the states stay at L.
    """
    n = int(hist.sum())
    if n == 0:
        return 0, 0
    symbols, _, freq, ideal = _stream_info(hist)
    head = table_len(symbols, freq) + LANES * _STATE_BYTES
    if symbols.size == 1:
        return head, head
    slack = 1e-9 * ideal + 1.0  # float rounding of the sum of n logarithms
    # An emitted word also takes up to log2(1 + 2^-15) bits more than 32 off (x ≥ 2^47 when it goes),
    # and there are at most n words.
    lo = max(0, math.ceil((ideal - slack + n * (math.log2(1 - _PRECISION) - math.log2(1 + _PRECISION))
                           - 32 * LANES) / 32))
    hi = math.floor((ideal + slack + n * math.log2(1 + _PRECISION)) / 32)
    return head + _WORD * lo, head + _WORD * hi


def ransx_encode(codes: np.ndarray, bits: int, hist: np.ndarray | None = None) -> np.ndarray:
    """The RANSX body (uint8) of ``codes`` (int32, valid for ``bits`` in 1..16: the caller checks).

    ``hist``: :func:`~dqsgd.codecs.rans.level_histogram` of the codes, when the caller already has it."""
    n = codes.size
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    if hist is None:
        hist = level_histogram(codes, bits)
    symbols, _, freq, _ = _stream_info(hist)
    _, hi = ransx_size_bounds(hist)
    tlen = table_len(symbols, freq)
    out = np.empty(hi, dtype=np.uint8)
    write_table(symbols, freq, out)
    xs = np.full(LANES, RANSX_L, dtype=np.int64)  # f = M (one symbol): every state stays at L, no words
    stream = np.zeros(0, dtype=np.uint8)
    if symbols.size > 1:
        ints, inv = _encoder_tables(symbols, freq, bits)
        words = np.empty((hi - tlen) // _WORD - 2 * LANES + 1, dtype=np.uint32)  # a spare word: checked, not trusted
        start = _encode(codes, 0 if bits == 1 else 1 << (bits - 1), bits == 1, ints, inv, words, xs)
        if start < 0:  # pragma: no cover - the bound is a proof
            raise RuntimeError("rANS stream exceeded its proven bound")
        stream = words[start:].astype("<u4", copy=False).view(np.uint8)
    out[tlen : tlen + LANES * _STATE_BYTES] = xs.astype("<u8").view(np.uint8)
    end = tlen + LANES * _STATE_BYTES + stream.size
    out[tlen + LANES * _STATE_BYTES : end] = stream
    return out[:end]


@njit(cache=True, inline="always")
def _dec_step(x, words, pw, symbols, freq, cum, slot_index):  # pragma: no cover - compiled
    """One lane's step: (the new state, the new word position, the code). Branch-free: the word at the
    position is read and kept only when the lane renormalises."""
    slot = x & (M - 1)
    k = np.int64(slot_index[slot])
    x = freq[k] * (x >> PROB_BITS) + slot - cum[k]
    take = np.int64(x < RANSX_L)  # at most one word: x ≥ ⌊x_before/M⌋ ≥ 2^15 here, so x < 2^63 after it
    x = (x << (32 * take)) | (np.int64(words[pw]) & -take)
    return x, pw + take, symbols[k]


@njit(cache=True, nogil=True)
def _decode(xs, words, out, symbols, freq, cum, slot_index):  # pragma: no cover - compiled
    """Decode ``out.size`` codes from the lanes' states ``xs`` and the stream ``words`` (one zero word
    appended); the number of words the codes needed (more than the stream has: it is truncated).

    Whole groups of 8 codes (lanes 0 … 7, states in locals: see :func:`_encode`) while 8 more words
    are there to read, then one code at a time, each reading the word at its position or the
    appended zero past the end. No counting here: a store to a count array may alias the states
    (the compiler then orders every lane's step after the one before); the caller counts the
    decoded codes in a second pass."""
    last = words.size - 1
    pw = np.int64(0)
    x0, x1, x2, x3, x4, x5, x6, x7 = xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7]
    g = 0
    while g < out.size // LANES and pw + LANES <= last:
        o = out[g * LANES : g * LANES + LANES]
        x0, pw, o[0] = _dec_step(x0, words, pw, symbols, freq, cum, slot_index)
        x1, pw, o[1] = _dec_step(x1, words, pw, symbols, freq, cum, slot_index)
        x2, pw, o[2] = _dec_step(x2, words, pw, symbols, freq, cum, slot_index)
        x3, pw, o[3] = _dec_step(x3, words, pw, symbols, freq, cum, slot_index)
        x4, pw, o[4] = _dec_step(x4, words, pw, symbols, freq, cum, slot_index)
        x5, pw, o[5] = _dec_step(x5, words, pw, symbols, freq, cum, slot_index)
        x6, pw, o[6] = _dec_step(x6, words, pw, symbols, freq, cum, slot_index)
        x7, pw, o[7] = _dec_step(x7, words, pw, symbols, freq, cum, slot_index)
        g += 1
    xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7] = x0, x1, x2, x3, x4, x5, x6, x7
    for i in range(g * LANES, out.size):
        p = min(pw, last)  # past the end: the appended zero
        xs[i & (LANES - 1)], q, out[i] = _dec_step(xs[i & (LANES - 1)], words, p, symbols, freq, cum, slot_index)
        pw += q - p
    return pw


def _states_and_words(buf: np.ndarray, p: int) -> tuple[int, np.ndarray, np.ndarray, int]:
    """(status, the lanes' states, the whole words after them plus a zero word, bytes left over) of
    the body ``buf`` whose table ends at ``p``."""
    if p + LANES * _STATE_BYTES > buf.size:
        return STATUS_TRUNC_STREAM, np.zeros(0, np.int64), np.zeros(1, np.uint32), 0
    xs = buf[p : p + LANES * _STATE_BYTES].view("<u8").astype(np.uint64)
    if (xs < RANSX_L).any() or (xs >= np.uint64(1 << 63)).any():
        return STATUS_STATE, xs.astype(np.int64), np.zeros(1, np.uint32), 0
    p += LANES * _STATE_BYTES
    nw = (buf.size - p) // _WORD
    words = np.zeros(nw + 1, dtype=np.uint32)
    words[:nw] = buf[p : p + _WORD * nw].view("<u4")
    return STATUS_OK, xs.astype(np.int64), words, buf.size - p - _WORD * nw


def ransx_decode(body: np.ndarray | bytes | memoryview, numel: int, bits: int, lo: int, hi: int,
                 zero_ok: bool) -> np.ndarray:
    """The ``numel`` int32 codes of a RANSX body; every code in ``[lo, hi]`` (0 only if ``zero_ok``).

    Raises:
      RansError: anything :func:`ransx_encode` could not have written (module docstring).
    """
    out, check = ransx_decode_uncounted(body, numel, bits, lo, hi, zero_ok)
    check(level_histogram(out, bits))
    return out


def ransx_decode_uncounted(body: np.ndarray | bytes | memoryview, numel: int, bits: int, lo: int, hi: int,
                           zero_ok: bool) -> tuple[np.ndarray, Callable[[np.ndarray], None]]:
    """:func:`ransx_decode` but for its last check: the codes, and that check as a function of their
    :func:`~dqsgd.codecs.rans.level_histogram` (it raises RansError unless the table lists exactly the
    codes that occur, with the normalised counts as frequencies), for a caller that counts the codes
    in a pass of its own. The codes are not valid until it has returned."""
    buf, out, symbols, freq, slot_index = decode_buffers(body, numel, bits, "RANSX")
    if numel == 0:
        return out, lambda hist: None
    status, pos, k = read_table(buf, bits, lo, hi, zero_ok, numel, symbols, freq, slot_index)
    if status == STATUS_OK:
        status, xs, words, left = _states_and_words(buf, pos)
        if status == STATUS_STATE:
            pos += _STATE_BYTES * int(np.argmax((xs < RANSX_L) | (xs < 0)))
    if status == STATUS_OK:
        cum = np.concatenate(([0], np.cumsum(freq[:k])[:-1])).astype(np.int64)
        used = _decode(xs, words, out, symbols, freq, cum, slot_index)
        nw = words.size - 1
        pos += LANES * _STATE_BYTES + _WORD * min(used, nw)
        status = (STATUS_TRUNC_STREAM if used > nw else STATUS_FINAL if (xs != RANSX_L).any()
                  else STATUS_TRAILING if used < nw or left else STATUS_OK)
    if status != STATUS_OK:
        raise RansError(STATUS_MESSAGES[status], int(pos))
    table = symbols[:k].astype(np.int64)
    rows = (table > 0).astype(np.int64) if bits == 1 else table + (1 << (bits - 1))
    return out, lambda hist: check_counts(hist[rows], symbols, freq[:k])
