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

import numpy as np
from numba import njit

from dqsgd.codecs.rans import (_MESSAGES, _OK, _STATE, _TRUNC_STREAM, _FINAL, _TRAILING, M, PROB_BITS, RansError,
                               _write_table, _table_len, check_counts, decode_buffers, level_histogram,
                               normalize, read_table)

__all__ = ["LANES", "RANSX_L", "ransx_decode", "ransx_encode", "ransx_size_bounds"]

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


@njit(cache=True, nogil=True)
def _encode(codes, offset, one_bit, ints, inv, out):  # pragma: no cover - compiled
    """Encode ``codes`` backwards into the tail of ``out`` (K ≥ 2); the first byte used, or −1 if full.

    The lanes' states live in a small array: the loop is one lane step, and consecutive steps
    belong to different lanes, so nothing waits for the step before it."""
    xs = np.full(LANES, RANSX_L, np.int64)
    p = np.int64(out.size)
    for i in range(codes.size - 1, -1, -1):
        c = np.int64(codes[i])
        u = np.int64(c > 0) if one_bit else c + offset
        x = xs[i & (LANES - 1)]
        if x >= ints[u, 0]:  # at most one word: x < 2^63, and x_max = 2^47·f > 2^31 after it
            if p < _WORD:
                return -1
            p -= _WORD
            for b in range(_WORD):
                out[p + b] = np.uint8((x >> (8 * b)) & 0xFF)
            x >>= 32
        f = ints[u, 1]
        q = np.int64(np.float64(x) * inv[u])  # ⌊x/f⌋ or one off: x/f < 2^47, the float error < 2^-4
        r = x - q * f
        if r < 0:
            q -= 1
            r += f
        elif r >= f:
            q += 1
            r -= f
        xs[i & (LANES - 1)] = (q << PROB_BITS) + r + ints[u, 2]
    if p < LANES * _STATE_BYTES:
        return -1
    p -= LANES * _STATE_BYTES
    for j in range(LANES):
        for b in range(_STATE_BYTES):
            out[p + _STATE_BYTES * j + b] = np.uint8((xs[j] >> (8 * b)) & 0xFF)
    return p


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
    head = _table_len(symbols, freq) + LANES * _STATE_BYTES
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
    out = np.empty(hi + _WORD, dtype=np.uint8)  # one spare word: the bound is checked, not trusted
    tlen = _write_table(symbols, freq, out)
    if symbols.size == 1:  # f = M: every state stays at L, no words
        out[tlen:hi] = np.frombuffer(np.full(LANES, RANSX_L, dtype="<u8").tobytes(), dtype=np.uint8)
        return out[:hi]
    ints, inv = _encoder_tables(symbols, freq, bits)
    start = _encode(codes, 0 if bits == 1 else 1 << (bits - 1), bits == 1, ints, inv, out[tlen:])
    if start < 0:  # pragma: no cover - the bound is a proof
        raise RuntimeError("rANS stream exceeded its proven bound")
    size = out.size - tlen - start
    out[tlen : tlen + size] = out[tlen + start :].copy()
    return out[: tlen + size]


@njit(cache=True, nogil=True)
def _decode(buf, p, out, symbols, freq, cum, slot_index):  # pragma: no cover - compiled
    """Decode ``out.size`` codes from the states at ``buf[p:]``; (status, position).

    No counting here: a store to a count array may alias the states (the compiler then orders
    every lane's step after the one before); the caller counts the decoded codes in a second pass."""
    end = buf.size
    if p + LANES * _STATE_BYTES > end:
        return _TRUNC_STREAM, p
    xs = np.zeros(LANES, np.int64)
    for j in range(LANES):
        for b in range(_STATE_BYTES):
            xs[j] |= np.int64(buf[p + _STATE_BYTES * j + b]) << (8 * b)
        if xs[j] < RANSX_L:  # a state ≥ 2^63 reads as negative
            return _STATE, p + _STATE_BYTES * j
    p += LANES * _STATE_BYTES
    for i in range(out.size):
        x = xs[i & (LANES - 1)]
        slot = x & (M - 1)
        k = np.int64(slot_index[slot])
        out[i] = symbols[k]
        x = freq[k] * (x >> PROB_BITS) + slot - cum[k]
        if x < RANSX_L:  # at most one word: x ≥ ⌊x_before/M⌋ ≥ 2^15 here
            if p + _WORD > end:
                return _TRUNC_STREAM, p
            x = (x << 32) | (np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8) | (np.int64(buf[p + 2]) << 16)
                             | (np.int64(buf[p + 3]) << 24))
            p += _WORD
        xs[i & (LANES - 1)] = x
    for j in range(LANES):
        if xs[j] != RANSX_L:
            return _FINAL, p
    if p != end:
        return _TRAILING, p
    return _OK, p


def ransx_decode(body: np.ndarray | bytes | memoryview, numel: int, bits: int, lo: int, hi: int,
                 zero_ok: bool) -> np.ndarray:
    """The ``numel`` int32 codes of a RANSX body; every code in ``[lo, hi]`` (0 only if ``zero_ok``).

    Raises:
      RansError: anything :func:`ransx_encode` could not have written (module docstring).
    """
    buf, out, symbols, freq, slot_index = decode_buffers(body, numel, bits, "RANSX")
    if numel == 0:
        return out
    status, pos, k = read_table(buf, bits, lo, hi, zero_ok, numel, symbols, freq, slot_index)
    if status == _OK:
        cum = np.concatenate(([0], np.cumsum(freq[:k])[:-1])).astype(np.int64)
        status, pos = _decode(buf, pos, out, symbols, freq, cum, slot_index)
    if status != _OK:
        raise RansError(_MESSAGES[status], int(pos))
    table = symbols[:k].astype(np.int64)
    check_counts(level_histogram(out, bits)[(table > 0).astype(np.int64) if bits == 1 else table + (1 << (bits - 1))],
                 symbols, freq[:k])
    return out
