"""Elias omega (recursive) coding of sparse signed integer codes: QSGD's Code_s.

Omega code of an integer k ≥ 1 (Elias 1975; docs/algorithms.md §1.3)::

    code ← "0";  while k > 1:  b ← binary(k);  code ← b ∥ code;  k ← len(b) − 1

ω(1) = "0", ω(2) = "100", ω(3) = "110", ω(4) = "101000", ω(17) = "10100100010".
Its length is ``L(k) = 1 + Σ_groups len(group)``, about log k + log log k + … + 1 bits.

Stream (bits written MSB first: stream bit j is bit ``7 − (j mod 8)`` of byte ``⌊j/8⌋``)::

    ω(nnz + 1)                              the number of non-zero codes (+1 so 0 is codable)
    for each non-zero code c_i, i ascending (indices start at 1, i_prev = 0):
        ω(i − i_prev) ∥ sign bit (1 = negative) ∥ ω(|c_i|)
    zero bits up to the next byte boundary

The leading count differs from QSGD's Code_s (which writes the bucket norm r there; our scales
live in the wire header): without it, zero padding would be indistinguishable from more
codes, since ω(1)·"0"·ω(1) = "000" is the code +1 at the next index.  The stream is canonical:
every valid payload has exactly one encoding, so decode → encode reproduces it bit for bit.
Total length in bits: ``L(nnz+1) + Σ_i [L(gap_i) + 1 + L(|c_i|)]`` (see :func:`elias_bit_length`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = [
    "EliasError",
    "elias_bit_length",
    "elias_decode",
    "elias_encode",
    "omega_encode_int",
    "omega_length",
]

# Largest integer the kernels code: ω(k) for k < 2^32 is at most 32+5+3+2+1 = 43 bits, so one
# code word fits a uint64 (the writer feeds it to its accumulator in pieces of ≤ 32 bits).
MAX_OMEGA = (1 << 32) - 1

# Outputs above this many codes, from a body of under numel/64 bytes, are validated before allocation.
_VALIDATE_FIRST_ABOVE = 1 << 18

# Decoder status codes (0 = ok); the message table turns them into text.
_OK, _TRUNCATED, _OVERFLOW, _COUNT, _GAP, _MAGNITUDE, _TRAILING, _PADDING = range(8)
_MESSAGES = {
    _TRUNCATED: "stream ends inside a code word",
    _OVERFLOW: "omega code word too long",
    _COUNT: "more non-zero codes than elements",
    _GAP: "index gap jumps past the end of the tensor",
    _MAGNITUDE: "code magnitude out of range",
    _TRAILING: "trailing bytes after the last code word",
    _PADDING: "non-zero padding bits after the last code word",
}


class EliasError(ValueError):
    """A malformed Elias stream; ``bit_offset`` is where the decoder stopped."""

    def __init__(self, message: str, bit_offset: int) -> None:
        super().__init__(f"{message} (at bit {bit_offset}, byte {bit_offset // 8} of the stream)")
        self.bit_offset = bit_offset


def omega_encode_int(k: int) -> str:
    """Reference ω(k) as a '0'/'1' string (pure Python, for tests)."""
    if k < 1:
        raise ValueError(f"omega code needs k ≥ 1, got {k}")
    code = "0"
    while k > 1:
        b = bin(k)[2:]
        code = b + code
        k = len(b) - 1
    return code


@njit(cache=True)
def _bit_length(k):  # pragma: no cover - compiled
    n = 0
    while k >= 256:
        k >>= 8
        n += 8
    while k > 0:
        k >>= 1
        n += 1
    return n


@njit(cache=True)
def omega_word(k):  # pragma: no cover - compiled
    """(bits, length) of ω(k), 1 ≤ k < 2^32: the groups are prepended to the final '0'."""
    word = np.uint64(0)
    length = 1
    while k > 1:
        b = _bit_length(k)
        word |= np.uint64(k) << np.uint64(length)
        length += b
        k = b - 1
    return word, length


# Tables for the common small values: the bit-length loops dominate dense streams otherwise.
# (The hot loops below index them directly: calling a numba helper that takes arrays costs
# ~10 ns of reference counting per call, more than the work itself.)
_TABLE = 1 << 12  # encoder: ω(k) for k < 4096 (at most 19 bits)
_PEEK = 16  # decoder: every ω(k) of at most 16 bits (k < 512), indexed by the next 16 bits


@njit(cache=True)
def _fill_tables(words, lengths, peek):  # pragma: no cover - compiled
    for k in range(1, words.size):
        w, n = omega_word(k)
        words[k] = w
        lengths[k] = n
        if n <= _PEEK:  # every 16-bit window that starts with ω(k) decodes to k
            lo = np.int64(w) << (_PEEK - n)
            for j in range(lo, lo + (np.int64(1) << (_PEEK - n))):
                peek[j] = (k << 5) | n


_WORDS = np.zeros(_TABLE, dtype=np.uint64)
OMEGA_LENGTHS = np.zeros(_TABLE, dtype=np.int64)
# k << 5 | L(k) (k < 512, L ≤ 16) in one uint16 (128 KiB: one cache-friendly load per word);
# 0 means the code word is longer than 16 bits.
_PEEK_TABLE = np.zeros(1 << _PEEK, dtype=np.uint16)
_fill_tables(_WORDS, OMEGA_LENGTHS, _PEEK_TABLE)


def omega_length(k: int) -> int:
    """``L(k)``: the number of bits of ω(k), k ≥ 1."""
    if not 1 <= k <= MAX_OMEGA:
        raise ValueError(f"omega_length needs 1 ≤ k < 2^32, got {k}")
    return int(omega_word(np.int64(k))[1])


@njit(cache=True)
def _scan(codes, lengths, stop_above):  # pragma: no cover - compiled
    """(stream bits before padding, number of non-zeros, largest |code|); stops early, with
    bits > stop_above, once the stream is known to be longer than ``stop_above``."""
    bits = 0
    nnz = 0
    prev = 0
    top = 0
    for i in range(codes.size):
        c = abs(np.int64(codes[i]))
        if c < 0:  # abs(-2^63) wraps: flag it as too large
            c = MAX_OMEGA + 1
        if c != 0:
            top = max(top, c)
            g = i + 1 - prev
            if c <= MAX_OMEGA:  # else the caller raises; keep the length loop bounded
                bits += (lengths[g] if g < _TABLE else omega_word(g)[1]) + 1
                bits += lengths[c] if c < _TABLE else omega_word(c)[1]
            prev = i + 1
            nnz += 1
            if bits > stop_above:
                break
    return bits + omega_word(nnz + 1)[1], nnz, top


@njit(cache=True)
def _encode(codes, nnz, out, words, lengths):  # pragma: no cover - compiled
    """Write the stream; ``out`` has exactly ⌈bits/8⌉ bytes.

    Bits collect MSB first in a 64-bit accumulator holding < 32 pending bits; whenever 32 are
    pending they are flushed as 4 big-endian bytes.  Each item is two words: ω(gap) and
    sign∥ω(|c|) (the count prefix is item −1, a single word), fed in pieces of ≤ 32 bits.
    """
    acc = np.uint64(0)
    nbits = 0
    pos = 0
    prev = 0
    for i in range(-1, codes.size):
        if i < 0:
            w0, l0 = omega_word(nnz + 1)
            w1, l1 = np.uint64(0), 0
        else:
            c = np.int64(codes[i])
            if c == 0:
                continue
            g = i + 1 - prev
            m = abs(c)
            prev = i + 1
            w0, l0 = (words[g], lengths[g]) if g < _TABLE else omega_word(g)
            w1, l1 = (words[m], lengths[m]) if m < _TABLE else omega_word(m)
            w1 |= np.uint64(c < 0) << np.uint64(l1)
            l1 += 1
        for piece in range(2):
            word, length = (w0, l0) if piece == 0 else (w1, l1)
            while length > 0:
                take = min(length, 32)
                length -= take
                part = (word >> np.uint64(length)) & ((np.uint64(1) << np.uint64(take)) - np.uint64(1))
                acc = (acc << np.uint64(take)) | part
                nbits += take
                if nbits >= 32:
                    nbits -= 32
                    top = acc >> np.uint64(nbits)
                    for b in range(4):
                        out[pos + b] = np.uint8((top >> np.uint64(24 - 8 * b)) & np.uint64(0xFF))
                    pos += 4
                    acc &= (np.uint64(1) << np.uint64(nbits)) - np.uint64(1)
    while nbits > 0:  # the last < 32 bits, zero-padded to a byte boundary
        nbits -= 8
        shifted = acc >> np.uint64(nbits) if nbits >= 0 else acc << np.uint64(-nbits)
        out[pos] = np.uint8(shifted & np.uint64(0xFF))
        pos += 1


def _scan_checked(codes: np.ndarray, stop_above: int = 1 << 62) -> tuple[np.ndarray, int, int]:
    """Validate codes (integer, < 2^32 elements, |code| < 2^32); return (array, bits, nnz)."""
    arr = np.ascontiguousarray(np.asarray(codes).reshape(-1))
    if arr.dtype.kind not in "iu":
        raise ValueError(f"Elias coding needs integer codes, got dtype {arr.dtype}")
    if arr.size >= MAX_OMEGA:
        raise ValueError(f"Elias coding supports < 2^32 - 1 elements, got {arr.size}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > MAX_OMEGA:
        raise ValueError("Elias coding supports |code| < 2^32")
    bits, nnz, top = _scan(arr, OMEGA_LENGTHS, stop_above)
    if top > MAX_OMEGA:
        raise ValueError(f"Elias coding supports |code| < 2^32, got {top}")
    return arr, int(bits), int(nnz)


def elias_bit_length(codes: np.ndarray, *, stop_above: int | None = None) -> int:
    """Exact stream length in bits (before the final padding) that :func:`elias_encode` writes:
    ``L(nnz+1) + Σ_i [L(gap_i) + 1 + L(|c_i|)]``.

    With ``stop_above``, the scan stops as soon as the length exceeds it and returns some value
    greater than ``stop_above`` (for "is Elias smaller than X?" without reading every code).
    """
    return _scan_checked(codes, (1 << 62) if stop_above is None else stop_above)[1]


def elias_encode(codes: np.ndarray) -> np.ndarray:
    """Encode signed integer codes as the stream of the module docstring (uint8 array)."""
    arr, nbits, nnz = _scan_checked(codes)
    out = np.empty((nbits + 7) // 8, dtype=np.uint8)
    _encode(arr, nnz, out, _WORDS, OMEGA_LENGTHS)
    return out


@njit(cache=True)
def _read_omega(buf, pos, limit):  # pragma: no cover - compiled
    """Decode one ω(k) bit by bit at ``pos``: (status, k, new pos); fails as soon as k must
    exceed ``limit``.  The slow path: used near the end of the buffer and for k ≥ 512."""
    total = buf.size * 8
    n = np.int64(1)
    while True:
        if pos >= total:
            return _TRUNCATED, n, pos
        bit = (buf[pos >> 3] >> (7 - (pos & 7))) & 1
        pos += 1
        if bit == 0:
            return _OK, n, pos
        # The next group is n+1 bits starting with the 1 just read, so the value becomes ≥ 2^n > n:
        # values grow every round (no endless loop) and overflow/limit is caught before reading.
        if n > 62 or (np.int64(1) << n) > limit:
            return _OVERFLOW, n, pos
        if pos + n > total:
            return _TRUNCATED, n, pos
        v = np.int64(1)
        for _ in range(n):
            v = (v << 1) | ((buf[pos >> 3] >> (7 - (pos & 7))) & 1)
            pos += 1
        n = v


@njit(cache=True)
def _read_item(buf, pos, gap_limit, neg_limit, pos_limit):  # pragma: no cover - compiled
    """Slow path for one (gap, sign, magnitude): (status, gap, signed code, new pos)."""
    st, gap, pos = _read_omega(buf, pos, gap_limit)
    if st == _OVERFLOW or (st == _OK and gap > gap_limit):
        return _GAP, 0, 0, pos
    if st != _OK or pos >= buf.size * 8:
        return _TRUNCATED, 0, 0, pos
    neg = (buf[pos >> 3] >> (7 - (pos & 7))) & 1
    limit = neg_limit if neg else pos_limit
    st, mag, pos = _read_omega(buf, pos + 1, limit)
    if st == _OVERFLOW or (st == _OK and mag > limit):
        return _MAGNITUDE, 0, 0, pos
    return st, gap, -mag if neg else mag, pos


@njit(cache=True)
def _decode(buf, numel, min_code, max_code, out, peek, write):  # pragma: no cover - compiled
    """Fill ``out`` (zeros, length numel; only validate if not ``write``); returns (status, bit position, nnz).

    Fast path: while 8 whole bytes remain, a 64-bit big-endian window shifted to ``pos`` holds
    ≥ 57 valid bits, enough for ω(gap) + sign + ω(|c|) when both words are ≤ 16 bits (table).
    """
    st, cnt, pos = _read_omega(buf, 0, numel + 1)
    if st != _OK:
        return st, pos, 0
    if cnt - 1 > numel:
        return _COUNT, pos, 0
    idx = 0
    for _ in range(cnt - 1):
        byte = pos >> 3
        lg = 0
        lm = 0
        if byte + 8 <= buf.size:
            win = np.uint64(0)
            for b in range(8):
                win = (win << np.uint64(8)) | np.uint64(buf[byte + b])
            win <<= np.uint64(pos & 7)
            eg = np.int64(peek[np.int64(win >> np.uint64(48))])
            lg = eg & 31
            if lg:
                em = np.int64(peek[np.int64((win >> np.uint64(47 - lg)) & np.uint64(0xFFFF))])
                lm = em & 31
        if lg and lm:
            gap = eg >> 5
            neg = np.int64(win >> np.uint64(63 - lg)) & 1
            code = -(em >> 5) if neg else em >> 5
            pos += lg + 1 + lm
            if gap > numel - idx:
                return _GAP, pos, 0
            if code < min_code or code > max_code:
                return _MAGNITUDE, pos, 0
        else:
            st, gap, code, pos = _read_item(buf, pos, numel - idx, -min_code, max_code)
            if st != _OK:
                return st, pos, 0
        idx += gap
        if write:
            out[idx - 1] = code
    if (pos + 7) // 8 != buf.size:
        return _TRAILING, pos, 0
    if pos & 7 and buf[pos >> 3] & ((1 << (8 - (pos & 7))) - 1):
        return _PADDING, pos, 0
    return _OK, pos, cnt - 1


def elias_decode(
    buf: bytes | bytearray | memoryview | np.ndarray,
    numel: int,
    *,
    min_code: int,
    max_code: int,
) -> tuple[np.ndarray, int]:
    """Decode a stream of exactly ``len(buf)`` bytes into ``numel`` int32 codes.

    Every read is bounds-checked, the number of codes is capped at ``numel``, and each code must
    lie in ``[min_code, max_code]`` (``min_code ≤ 0 ≤ max_code``).

    Returns:
      (codes, nnz): int32 array of length numel and the number of non-zero codes.

    Raises:
      EliasError: truncated stream, over-long code word, count/gap past numel, magnitude out of
        range, trailing bytes or non-zero padding bits.
    """
    if not (-(1 << 31) <= min_code <= 0 <= max_code < (1 << 31)):
        raise ValueError(f"code range [{min_code}, {max_code}] must contain 0 and fit int32")
    if not 0 <= numel < MAX_OMEGA:
        raise ValueError(f"numel must be in 0..2^32-2, got {numel}")
    data = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1)
    if numel > max(_VALIDATE_FIRST_ABOVE, 64 * data.size):
        # Mostly implicit zeros: validate the stream (O(len(buf)) work) before allocating numel codes.
        status, pos, _ = _decode(data, numel, min_code, max_code, np.zeros(0, dtype=np.int32), _PEEK_TABLE, False)
        if status != _OK:
            raise EliasError(_MESSAGES[status], int(pos))
    out = np.zeros(numel, dtype=np.int32)
    status, pos, nnz = _decode(data, numel, min_code, max_code, out, _PEEK_TABLE, True)
    if status != _OK:
        raise EliasError(_MESSAGES[status], int(pos))
    return out, int(nnz)
