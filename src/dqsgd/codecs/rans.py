"""Static order-0 rANS coding of the quantization levels: ``Coding.RANS``.

Symbols are the codes in FIXED's offset binary, ``u = code + 2^(b−1)`` (b ≥ 2) or
``u = 1 if code > 0 else 0`` (b = 1), so ``0 ≤ u < 2^b ≤ 2^16``.  A body of ``n`` codes is
(n = 0: the empty body)::

    varint K                         distinct symbols, 1 ≤ K ≤ min(2^b, n)
    K × (varint gap, varint freq)    symbols ascending: u_0 = gap_0, u_k = u_(k−1) + 1 + gap_k;
                                     1 ≤ freq_k, Σ freq_k = M = 2^16 (PROB_BITS = 16)
    u32 state                        the encoder's final state x, little-endian, L ≤ x < 2^8·L
    stream bytes                     the renormalisation bytes, in the order the decoder reads them

Varints are unsigned LEB128, at most 3 bytes, and minimal (no trailing 0x80 … 0x00 groups).
The frequencies are :func:`normalize` of the symbol counts: symbols so rare that a proportional
share would round to 0 get 1 (the rarest first, until every other symbol's share is ≥ 1), the
rest share what is left in proportion to their counts (floor, then +1 to the largest remainders;
ties to the lower symbol). The decoder requires exactly that table, every listed symbol to occur,
and so a decoded body re-encodes to the same bytes.

The coder is ryg's byte-wise rANS with a 32-bit state: ``L = 2^23``, state in ``[L, 2^31)``.
Encoding runs over the codes backwards from ``x = L``: before coding ``u`` (frequency ``f``,
cumulative frequency ``c``), while ``x ≥ 2^15·f`` emit ``x & 0xFF`` and ``x >>= 8``; then
``x ← ⌊x/f⌋·M + (x mod f) + c``.  Decoding runs forwards: ``slot = x mod M``, the symbol whose
``[c, c+f)`` holds ``slot``, ``x ← f·⌊x/M⌋ + slot − c``, and while ``x < L`` read a byte
``x ← 256·x + byte``.  After ``n`` symbols the decoder must be back at ``x = L`` with every
stream byte read.  The coded size is ``Σ log2(M/f_u)`` bits plus at most ``log2(1 + 2^-7)``
bits per symbol of state rounding (about 0.1 % of a bit on average), plus 4 state bytes.

Decoding is strict and bounded: every table field and every stream byte is checked against the
end of the body before it is read, and nothing is allocated from an unchecked size (the output
has the header's numel elements, which the caller bounds; the tables have ``2^b`` and ``M``).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["PROB_BITS", "RansError", "level_histogram", "normalize", "rans_decode", "rans_encode", "rans_size_bounds",
           "rans_table"]

PROB_BITS = 16
M = 1 << PROB_BITS
RANS_L = 1 << 23  # lower bound of the normalised state; the upper bound is 2^8·L = 2^31
_XMAX_UNIT = (RANS_L >> PROB_BITS) << 8  # encoder renormalises while x ≥ _XMAX_UNIT·f
_VARINT_MAX_BYTES = 3

# Decoder status codes (0 = ok); the message table turns them into text.
(STATUS_OK, _TRUNC_TABLE, _VARINT, _COUNT, _SYMBOL, _RANGE, _FREQ, _SUM, STATUS_STATE, STATUS_TRUNC_STREAM,
 STATUS_FINAL, STATUS_TRAILING) = range(12)
STATUS_MESSAGES = {
    _TRUNC_TABLE: "frequency table truncated",
    _VARINT: "malformed varint (longer than 3 bytes, or not minimal)",
    _COUNT: "symbol count out of range",
    _SYMBOL: "symbol out of range for the bit width",
    _RANGE: "symbol is a code the scheme does not allow",
    _FREQ: "frequency out of range (must be 1..65536)",
    _SUM: "frequencies do not sum to 65536",
    STATUS_STATE: "initial state out of range",
    STATUS_TRUNC_STREAM: "stream truncated",
    STATUS_FINAL: "final state is not the initial state",
    STATUS_TRAILING: "trailing bytes after the rANS stream",
}


class RansError(ValueError):
    """A malformed rANS body; ``offset`` is the byte of the body where the decoder stopped."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(f"{message} (at byte {offset} of the body)")
        self.offset = offset


# ------------------------------------------------------------------------------ the table


def normalize(counts: np.ndarray) -> np.ndarray:
    """Frequencies (int64, each ≥ 1, summing to 2^16) for positive ``counts`` (1 ≤ K ≤ 2^16 of them).

    Deterministic integer arithmetic (module docstring): the decoder re-derives it to check a table.
    """
    counts = np.asarray(counts, dtype=np.int64)
    k = counts.size
    if not 1 <= k <= M or (counts <= 0).any():
        raise ValueError(f"normalize needs 1..{M} positive counts, got {k}")
    n = int(counts.sum())
    order = np.argsort(counts, kind="stable")  # ascending; ties by symbol
    sc = counts[order]
    prefix = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(sc, out=prefix[1:])
    # The first r at which the r rarest symbols (frequency 1 each) leave every other one a share ≥ 1;
    # r = K − 1 always qualifies (the largest then gets M − K + 1 ≥ 1). Products < 2^32 · 2^16.
    ok = sc * (M - np.arange(k, dtype=np.int64)) >= n - prefix[:-1]
    r = int(np.argmax(ok))
    share_total, weight = M - r, n - int(prefix[r])
    freq = np.ones(k, dtype=np.int64)
    big = np.sort(order[r:])  # by symbol, so that ties in the remainder go to the lower symbol
    cb = counts[big]
    share, rem = np.divmod(cb * share_total, weight)
    deficit = share_total - int(share.sum())
    if deficit:
        share[np.lexsort((big, -rem))[:deficit]] += 1  # largest remainders; ties: lower symbol
    freq[big] = share
    return freq


@njit(cache=True, nogil=True)
def _histogram(codes, offset, one_bit, nsym):  # pragma: no cover - compiled
    """Counts of the symbols, in four partial histograms summed at the end: consecutive codes are
    mostly the same level, and one histogram would chain every increment on the one before (3x)."""
    part = np.zeros((4, nsym), np.int64)
    n4 = codes.size // 4 * 4
    for i in range(0, n4, 4):
        for k in range(4):
            c = np.int64(codes[i + k])
            part[k, np.int64(c > 0) if one_bit else c + offset] += 1
    for i in range(n4, codes.size):
        c = np.int64(codes[i])
        part[0, np.int64(c > 0) if one_bit else c + offset] += 1
    hist = part[0].copy()
    for k in range(1, 4):
        hist += part[k]
    return hist


@njit(cache=True, nogil=True)
def _put_varint(out, p, v):  # pragma: no cover - compiled
    while v >= 0x80:
        out[p] = np.uint8((v & 0x7F) | 0x80)
        v >>= 7
        p += 1
    out[p] = np.uint8(v)
    return p + 1


@njit(cache=True, nogil=True)
def write_table(symbols, freq, out):  # pragma: no cover - compiled
    p = _put_varint(out, 0, np.int64(symbols.size))
    prev = np.int64(-1)
    for k in range(symbols.size):
        p = _put_varint(out, p, np.int64(symbols[k]) - prev - 1)
        p = _put_varint(out, p, np.int64(freq[k]))
        prev = np.int64(symbols[k])
    return p


def rans_table(codes: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(symbols, counts, frequencies) of the codes' offset-binary symbols (int64 arrays, by symbol)."""
    hist = level_histogram(codes, bits)
    symbols = np.flatnonzero(hist).astype(np.int64)
    counts = hist[symbols]
    return symbols, counts, normalize(counts)


# ------------------------------------------------------------------------------ encode


def _encoder_tables(symbols: np.ndarray, freq: np.ndarray, bits: int) -> np.ndarray:
    """Per symbol u (a row of 2^b, only the occurring ones filled): x_max, the reciprocal of f, its
    shift, the bias and M − f, for the division-free step of ryg's rans_byte (``RansEncSymbolInit``).

    For ``x < 2^31``: ``q = ⌊x·rcp / 2^32⌋ >> shift = ⌊x/f⌋`` (f ≥ 2: rcp = ⌈2^(31+sh)/f⌉ with
    2^(sh−1) < f ≤ 2^sh; f = 1: rcp = 2^32 − 1, shift 0 gives q = x − 1 and the bias adds the rest),
    and ``x + bias + q·(M − f) = ⌊x/f⌋·M + (x mod f) + c``: the same state as the division.
    """
    table = np.zeros((1 << bits, 5), dtype=np.uint64)
    cum = 0
    for u, f in zip(symbols.tolist(), freq.tolist()):
        if f < 2:
            rcp, shift, bias = (1 << 32) - 1, 0, cum + M - 1
        else:
            sh = (f - 1).bit_length()  # 2^(sh−1) < f ≤ 2^sh
            rcp, shift, bias = ((1 << (sh + 31)) + f - 1) // f, sh - 1, cum
        table[u] = (_XMAX_UNIT * f, rcp, shift, bias, M - f)
        cum += f
    return table


@njit(cache=True, nogil=True)
def _encode(codes, offset, one_bit, table, out):  # pragma: no cover - compiled
    """rANS-encode ``codes`` backwards into the tail of ``out``; the first byte used, or −1 if full.

    The state step is ryg's division-free form (:func:`_encoder_tables`); renormalisation emits at
    most two bytes per symbol (x < 2^31 and x_max = 2^15·f ≥ 2^15, so x < x_max after two).
    """
    n = codes.size
    x = np.uint64(RANS_L)
    p = out.size
    eight = np.uint64(8)
    for j in range(n):
        c = np.int64(codes[n - 1 - j])
        u = np.int64(c > 0) if one_bit else c + offset
        xmax = table[u, 0]
        for _ in range(2):  # at most two bytes (see above): a bounded loop the compiler unrolls
            if x < xmax:
                break
            if p < 1:
                return -1
            p -= 1
            out[p] = np.uint8(x & np.uint64(0xFF))
            x >>= eight
        q = ((x * table[u, 1]) >> np.uint64(32)) >> table[u, 2]
        x = x + table[u, 3] + q * table[u, 4]
    if p < 4:
        return -1
    p -= 4
    for b in range(4):
        out[p + b] = np.uint8((x >> np.uint64(8 * b)) & np.uint64(0xFF))
    return p


def level_histogram(codes: np.ndarray, bits: int) -> np.ndarray:
    """int64 counts of the codes' offset-binary symbols ``u`` (``2^bits`` of them; valid codes only)."""
    return _histogram(codes, 0 if bits == 1 else 1 << (bits - 1), bits == 1, 1 << bits)


def _varint_len(v: np.ndarray) -> np.ndarray:
    """Bytes of each unsigned LEB128 varint (values < 2^21: at most 3)."""
    return 1 + (v >= 1 << 7) + (v >= 1 << 14)


def table_len(symbols: np.ndarray, freq: np.ndarray) -> int:
    gaps = np.diff(symbols, prepend=-1) - 1
    return int(_varint_len(np.array([symbols.size])).sum() + _varint_len(gaps).sum() + _varint_len(freq).sum())


def rans_size_bounds(hist: np.ndarray) -> tuple[int, int]:
    """(lo, hi) with lo ≤ len(rans_encode(codes, bits)) ≤ hi for any codes whose histogram is ``hist``.

    The table is exact (its varints); the stream is not a function of the histogram (the state's
    rounding depends on the order of the codes), but each symbol moves log2 x by log2(M/f) within
    log2(1 ± 2^-7) (x ≥ 2^7·f when it is coded), and x starts at L and ends in [L, 2^8·L): so with
    I = Σ_u count_u·log2(M/f_u) the stream has between (I + n·log2(1 − 2^-7) − 8)/8 and
    (I + n·log2(1 + 2^-7))/8 bytes, plus the 4 state bytes.
    """
    n = int(hist.sum())
    if n == 0:
        return 0, 0
    symbols = np.flatnonzero(hist).astype(np.int64)
    counts = hist[symbols]
    freq = normalize(counts)
    ideal = float((counts * (PROB_BITS - np.log2(freq))).sum())
    slack = 1e-9 * ideal + 1.0  # float rounding of the sum of n logarithms
    lo = max(0, math.floor((ideal - slack + n * math.log2(1 - 2.0**-7) - 8) / 8))
    hi = math.ceil((ideal + slack + n * math.log2(1 + 2.0**-7)) / 8)
    head = table_len(symbols, freq) + 4
    return head + lo, head + hi


def rans_encode(codes: np.ndarray, bits: int, hist: np.ndarray | None = None) -> np.ndarray:
    """The RANS body (uint8) of ``codes`` (int32, valid for ``bits`` in 1..16: the caller checks).

    ``hist``: :func:`level_histogram` of the codes, when the caller already has it."""
    n = codes.size
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    if hist is None:
        hist = level_histogram(codes, bits)
    symbols = np.flatnonzero(hist).astype(np.int64)
    counts = hist[symbols]
    freq = normalize(counts)
    table = np.empty(_VARINT_MAX_BYTES * (1 + 2 * symbols.size), dtype=np.uint8)
    tlen = write_table(symbols, freq, table)
    # Stream bound: each symbol grows log2(x) by < log2(M/f) + log2(1 + 2^-7) and each byte takes
    # 8 bits off; or at most ⌈(16 − ⌊log2 f⌋)/8⌋ bytes per symbol.  The encoder checks it anyway.
    ideal = float((counts * (PROB_BITS - np.log2(freq))).sum()) + n * math.log2(1 + 2.0**-7)
    exact = int((counts * ((PROB_BITS - np.floor(np.log2(freq)).astype(np.int64) + 7) // 8)).sum())
    cap = min(exact, int(ideal * (1 + 1e-9) / 8) + 16) + 4
    out = np.empty(tlen + cap, dtype=np.uint8)
    start = _encode(codes, 0 if bits == 1 else 1 << (bits - 1), bits == 1, _encoder_tables(symbols, freq, bits),
                    out[tlen:])
    if start < 0:  # pragma: no cover - the bound above is a proof
        raise RuntimeError("rANS stream exceeded its proven bound")
    stream = out[tlen + start :]
    out[tlen : tlen + stream.size] = stream.copy()
    out[:tlen] = table[:tlen]
    return out[: tlen + stream.size]


# ------------------------------------------------------------------------------ decode


@njit(cache=True, nogil=True)
def _get_varint(buf, p, end):  # pragma: no cover - compiled
    """(value, next position, status)."""
    v = np.int64(0)
    for i in range(_VARINT_MAX_BYTES):
        if p >= end:
            return v, p, _TRUNC_TABLE
        b = np.int64(buf[p])
        p += 1
        v |= (b & 0x7F) << (7 * i)
        if b < 0x80:
            if b == 0 and i > 0:
                return v, p - 1, _VARINT
            return v, p, STATUS_OK
    return v, p - 1, _VARINT


@njit(cache=True, nogil=True)
def read_table(buf, bits, lo, hi, zero_ok, n, symbols, freq, slot_index):  # pragma: no cover - compiled
    """Parse and check a frequency table (module docstring) at the start of ``buf`` for ``n`` codes,
    whose frequencies sum to ``2^prob_bits = slot_index.size``: symbols (as codes), frequencies and the
    slot → table index map are filled in; (status, position after the table, K)."""
    end = buf.size
    m = np.int64(slot_index.size)
    nsym = np.int64(1) << bits
    offset = np.int64(0) if bits == 1 else np.int64(1) << (bits - 1)
    k, p, st = _get_varint(buf, 0, end)
    if st != STATUS_OK:
        return st, p, 0
    if k < 1 or k > nsym or k > n or k > m:
        return _COUNT, 0, 0
    u = np.int64(-1)
    total = np.int64(0)
    for j in range(k):
        at = p
        gap, p, st = _get_varint(buf, p, end)
        if st != STATUS_OK:
            return st, p, 0
        u += gap + 1
        if u >= nsym:
            return _SYMBOL, at, 0
        code = 2 * u - 1 if bits == 1 else u - offset
        if code < lo or code > hi or (code == 0 and not zero_ok):
            return _RANGE, at, 0
        at = p
        f, p, st = _get_varint(buf, p, end)
        if st != STATUS_OK:
            return st, p, 0
        if f < 1 or f > m:
            return _FREQ, at, 0
        if total + f > m:
            return _SUM, at, 0
        for s in range(total, total + f):  # total + f ≤ m = slot_index.size; j < K ≤ the dtype's range
            slot_index[s] = j
        symbols[j] = code
        freq[j] = f
        total += f
    if total != m:
        return _SUM, p, 0
    return STATUS_OK, p, k


@njit(cache=True, nogil=True)
def _decode(buf, bits, lo, hi, zero_ok, out, symbols, freq, counts, slot_index):  # pragma: no cover - compiled
    """Parse the table and decode ``out.size`` codes; (status, position, number of table symbols)."""
    end = buf.size
    n = out.size
    st, p, k = read_table(buf, bits, lo, hi, zero_ok, n, symbols, freq, slot_index)
    if st != STATUS_OK:
        return st, p, 0
    if p + 4 > end:
        return STATUS_TRUNC_STREAM, p, k
    x = np.uint64(0)
    for b in range(4):
        x |= np.uint64(buf[p + b]) << np.uint64(8 * b)
    if x < np.uint64(RANS_L) or x >= np.uint64(RANS_L) << np.uint64(8):
        return STATUS_STATE, p, k
    p += 4
    cum = np.zeros(k, np.int64)
    for j in range(1, k):
        cum[j] = cum[j - 1] + freq[j - 1]
    mask = np.uint64(M - 1)
    for i in range(n):
        slot = x & mask  # < M
        j = np.int64(slot_index[slot])
        out[i] = symbols[j]
        counts[j] += 1
        x = np.uint64(freq[j]) * (x >> np.uint64(PROB_BITS)) + slot - np.uint64(cum[j])  # < 2^31
        while x < np.uint64(RANS_L):
            if p >= end:
                return STATUS_TRUNC_STREAM, p, k
            x = (x << np.uint64(8)) | np.uint64(buf[p])
            p += 1
    if x != np.uint64(RANS_L):
        return STATUS_FINAL, p, k
    if p != end:
        return STATUS_TRAILING, p, k
    return STATUS_OK, p, k


def decode_buffers(body: np.ndarray | bytes | memoryview, numel: int, bits: int,
                   name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(body bytes, output codes, table symbols, frequencies, slot → table index) of a ``name`` body of
    ``numel`` codes: the output has numel elements (the caller bounds it), the tables 2^b and M."""
    buf = np.frombuffer(body, dtype=np.uint8)
    if not 1 <= bits <= 16:
        raise ValueError(f"{name} carries codes of 1..16 bits, not {bits}")
    if numel == 0 and buf.size:
        raise RansError(f"{buf.size} bytes in the body of an empty tensor", 0)
    nsym = max(1, min(1 << bits, numel))
    # The slot → symbol table is read at random: one byte per slot where 256 symbols fit (a quarter of the
    # cache an int32 table takes), else two.
    return (buf, np.empty(numel, dtype=np.int32), np.zeros(nsym, dtype=np.int32), np.zeros(nsym, dtype=np.int64),
            np.zeros(M, dtype=np.uint8 if nsym <= 256 else np.uint16))


def check_counts(counts: np.ndarray, symbols: np.ndarray, freq: np.ndarray) -> None:
    """Refuse a table whose symbols do not all occur, or that is not :func:`normalize` of the counts."""
    if (counts == 0).any():
        j = int(np.argmax(counts == 0))
        raise RansError(f"code {int(symbols[j])} is in the frequency table but never occurs", 0)
    if not np.array_equal(normalize(counts), freq):
        raise RansError("frequency table is not the normalised counts of the decoded codes", 0)


def rans_decode(body: np.ndarray | bytes | memoryview, numel: int, bits: int, lo: int, hi: int,
                zero_ok: bool) -> np.ndarray:
    """The ``numel`` int32 codes of a RANS body; every code in ``[lo, hi]`` (0 only if ``zero_ok``).

    Raises:
      RansError: anything :func:`rans_encode` could not have written (module docstring).
    """
    buf, out, symbols, freq, slot_index = decode_buffers(body, numel, bits, "RANS")
    if numel == 0:
        return out
    counts = np.zeros(symbols.size, dtype=np.int64)
    status, pos, k = _decode(buf, bits, lo, hi, zero_ok, out, symbols, freq, counts, slot_index)
    if status != STATUS_OK:
        raise RansError(STATUS_MESSAGES[status], int(pos))
    check_counts(counts[:k], symbols, freq[:k])
    return out
