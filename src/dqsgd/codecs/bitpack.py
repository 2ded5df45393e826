"""Fixed-width bit packing: the one packing implementation of dqsgd.

Stream format (little-endian bit order, as ``numpy.packbits(..., bitorder="little")`` for w = 1):

* value ``i`` occupies stream bits ``[i·w, (i+1)·w)``, least significant bit first;
* stream bit ``j`` is bit ``j mod 8`` (LSB = 0) of byte ``⌊j/8⌋``;
* the stream is exactly ``⌈count·w/8⌉`` bytes; the unused high bits of the last byte are zero.

So 8 values of width w fill exactly w bytes, which is how the kernels work: one group of eight
values is one little-endian integer of 8·w bits.  ``offset`` lets signed codes travel in offset
binary (``u = code + offset``) without a temporary array: packing reads ``u_i + offset`` and
unpacking returns ``u_i − offset``.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import njit

__all__ = ["pack_bits", "unpack_bits", "packed_size"]

MAX_WIDTH = 32

_U8 = np.uint64(8)
_U32 = np.uint64(32)
_BYTE = np.uint64(0xFF)

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("dqsgd.codecs.bitpack assumes a little-endian host")


def packed_size(count: int, width: int) -> int:
    """Bytes of a packed stream: ``⌈count·width/8⌉``."""
    return (count * width + 7) // 8


@njit(cache=True, nogil=True)
def pack_small(u, width, offset, out, check=True):  # pragma: no cover - compiled
    """w ≤ 8: each group of 8 values is a (8·w)-bit integer written as w bytes.

    Returns True when some ``u_i + offset`` lies outside ``[0, 2^w)``; the range flag is OR-ed
    instead of branched on so that LLVM can vectorise the inner loop. ``check = False`` (callers
    whose values fit by construction, inlined with a constant) drops the check: it cost 20% of
    the fused encoder's time (measured).
    """
    n = u.size
    maxv = (np.int64(1) << width) - 1
    bad = False
    uw = np.uint64(width)
    for g in range(n // 8):
        acc = np.uint64(0)
        for k in range(8):
            v = np.int64(u[g * 8 + k]) + offset
            if check:
                bad |= (v < 0) | (v > maxv)
            acc |= np.uint64(v & maxv) << (np.uint64(k) * uw)
        for b in range(width):
            out[g * width + b] = np.uint8((acc >> (np.uint64(b) * _U8)) & _BYTE)
    return bad


@njit(cache=True, nogil=True)
def pack_pow2(u, width, offset, out, check=True):  # pragma: no cover - compiled
    """w ∈ {1, 2, 4, 8}: byte i holds values ``i·8/w …`` whole; the first ``⌊count·w/8⌋`` bytes.

    The loop runs over output bytes with fixed-stride loads, which LLVM vectorizes (4-5x the
    group-of-eight kernel at w = 4, measured); the range flag is an OR-reduction for the same
    reason, and ``check`` as in ``pack_small``.
    """
    per = 8 // width
    o = out[: u.size // per]
    over = np.int64(0)
    for i in range(o.size):  # from 0 over a slice: no negative-index wrap-around in the loop
        acc = np.int64(0)
        for k in range(per):
            v = np.int64(u[i * per + k]) + offset
            if check:
                over |= v
            acc |= v << (k * width)
        o[i] = np.uint8(acc & 0xFF)
    return (over >> width) != 0  # some v < 0 (sign bit set) or v ≥ 2^w


@njit(cache=True, nogil=True)
def pack_aligned(u, width, offset, out, check=True):  # pragma: no cover - compiled
    """w ∈ {16, 32}: every value is exactly w/8 whole bytes, little-endian (``check``: ``pack_small``)."""
    maxv = (np.int64(1) << width) - 1
    nb = width // 8
    bad = False
    for i in range(u.size):
        v = np.int64(u[i]) + offset
        if check:
            bad |= (v < 0) | (v > maxv)
        for b in range(nb):
            out[i * nb + b] = np.uint8((v >> (8 * b)) & 0xFF)
    return bad


@njit(cache=True, nogil=True)
def pack_stream(u, start, width, offset, out, out_start):  # pragma: no cover - compiled
    """Any w ≤ 32, from value ``start`` on: a 64-bit accumulator, flushed 32 bits at a time."""
    maxv = (np.int64(1) << width) - 1
    bad = False
    acc = np.uint64(0)
    nbits = np.uint64(0)
    uw = np.uint64(width)
    o = out_start
    for i in range(start, u.size):
        v = np.int64(u[i]) + offset
        bad |= (v < 0) | (v > maxv)
        acc |= np.uint64(v & maxv) << nbits  # nbits < 32 and v < 2^32: fits in 64 bits
        nbits += uw
        if nbits >= _U32:
            for b in range(4):
                out[o + b] = np.uint8((acc >> (np.uint64(b) * _U8)) & _BYTE)
            o += 4
            acc >>= _U32
            nbits -= _U32
    while nbits > 0:  # the tail: whole bytes plus one partial byte, zero-padded
        out[o] = np.uint8(acc & _BYTE)
        o += 1
        acc >>= _U8
        nbits = nbits - _U8 if nbits > _U8 else np.uint64(0)
    return bad


@njit(cache=True, nogil=True)
def unpack_small(buf, width, count, offset, out):  # pragma: no cover - compiled
    """w ≤ 8 inverse of ``pack_small`` for the first ``8·⌊count/8⌋`` values."""
    mask = np.uint64((1 << width) - 1)
    uw = np.uint64(width)
    for g in range(count // 8):
        acc = np.uint64(0)
        for b in range(width):
            acc |= np.uint64(buf[g * width + b]) << (np.uint64(b) * _U8)
        for k in range(8):
            out[g * 8 + k] = np.int64((acc >> (np.uint64(k) * uw)) & mask) - offset


@njit(cache=True, nogil=True)
def unpack_pow2(buf, width, count, offset, out):  # pragma: no cover - compiled
    """w ∈ {1, 2, 4, 8}: inverse of ``pack_pow2`` for the first ``⌊count·w/8⌋·8/w`` values."""
    per = 8 // width
    mask = (1 << width) - 1
    for i in range(count // per):
        b = np.int32(buf[i])
        for k in range(per):
            out[i * per + k] = ((b >> (k * width)) & mask) - offset


@njit(cache=True, nogil=True)
def unpack_aligned(buf, width, count, offset, out):  # pragma: no cover - compiled
    """w ∈ {16, 32}: inverse of ``pack_aligned``."""
    nb = width // 8
    for i in range(count):
        v = np.int64(0)
        for b in range(nb):
            v |= np.int64(buf[i * nb + b]) << (8 * b)
        out[i] = v - offset


@njit(cache=True, nogil=True)
def unpack_stream(buf, start, width, count, offset, out):  # pragma: no cover - compiled
    """Any w ≤ 32, values ``[start, count)``; ``start·w`` must be a multiple of 8."""
    mask = np.uint64((1 << width) - 1)
    uw = np.uint64(width)
    p = start * width // 8
    nbuf = buf.size
    acc = np.uint64(0)
    nbits = np.uint64(0)
    for i in range(start, count):
        if nbits < uw:  # refill 32 bits (fewer at the end of the buffer: never read past it)
            for b in range(4):
                if p < nbuf:
                    acc |= np.uint64(buf[p]) << nbits
                    p += 1
                nbits += _U8
        out[i] = np.int64(acc & mask) - offset
        acc >>= uw
        nbits -= uw


def _check_width(width: int) -> int:
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)):
        raise ValueError(f"bit width must be an int, got {type(width).__name__}")
    if not 1 <= int(width) <= MAX_WIDTH:
        raise ValueError(f"bit width must be in 1..{MAX_WIDTH}, got {width}")
    return int(width)


def _as_integer_array(u: np.ndarray) -> np.ndarray:
    arr = np.asarray(u)
    if arr.dtype == np.bool_:
        arr = arr.view(np.uint8)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"pack_bits needs an integer array, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr.reshape(-1))
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 1 << 63:
        # The kernels read values as int64; these would wrap around instead of being refused.
        raise ValueError(f"value {int(arr.max())} does not fit in 32 bits")
    return arr


def pack_bits(u: np.ndarray, width: int, *, offset: int = 0) -> np.ndarray:
    """Pack ``u_i + offset`` (each in ``[0, 2^width)``) into ``⌈len(u)·width/8⌉`` bytes.

    Args:
      u: integer (or bool) array of any shape, read in C order.
      width: bits per value, 1..32.
      offset: added to every value before packing (offset binary for signed codes).

    Returns:
      uint8 array in the format of the module docstring.

    Raises:
      ValueError: bad width, non-integer input, or a value that does not fit in ``width`` bits.
    """
    width = _check_width(width)
    arr = _as_integer_array(u)
    out = np.empty(packed_size(arr.size, width), dtype=np.uint8)
    if width in (16, 32):
        bad = pack_aligned(arr, width, int(offset), out)
    elif width in (1, 2, 4, 8):
        done = (arr.size // (8 // width)) * (8 // width)
        bad = pack_pow2(arr, width, int(offset), out)
        bad |= pack_stream(arr, done, width, int(offset), out, done * width // 8)
    else:
        done = (arr.size // 8) * 8 if width <= 8 else 0
        bad = width <= 8 and pack_small(arr, width, int(offset), out)
        bad |= pack_stream(arr, done, width, int(offset), out, done * width // 8)
    if bad:
        shifted = arr.astype(np.int64) + int(offset)
        i = int(np.flatnonzero((shifted < 0) | (shifted >= (1 << width)))[0])
        raise ValueError(f"value {int(arr[i])} at index {i} does not fit in {width} bits (offset {offset})")
    return out


def _output_dtype(width: int, offset: int, dtype: np.dtype | type | None) -> np.dtype:
    if dtype is None:
        dtype = np.uint8 if width <= 8 else np.uint16 if width <= 16 else np.uint32
        if offset:
            dtype = np.int64
    dt = np.dtype(dtype)
    if dt.kind not in "iu":
        raise ValueError(f"unpack_bits needs an integer output dtype, got {dt}")
    info = np.iinfo(dt)
    if -offset < info.min or (1 << width) - 1 - offset > info.max:
        raise ValueError(f"dtype {dt} cannot hold {width}-bit values minus offset {offset}")
    return dt


def unpack_bits(
    buf: bytes | bytearray | memoryview | np.ndarray,
    width: int,
    count: int,
    *,
    offset: int = 0,
    dtype: np.dtype | type | None = None,
) -> np.ndarray:
    """Inverse of :func:`pack_bits`: the first ``count`` values of width ``width``, minus ``offset``.

    Args:
      buf: at least ``⌈count·width/8⌉`` bytes (extra bytes are ignored).
      width: bits per value, 1..32.
      count: number of values.
      offset: subtracted from every value.
      dtype: output dtype; default the smallest unsigned type holding ``width`` bits (int64 when
        ``offset`` is non-zero).  It must hold every ``u − offset``.

    Raises:
      ValueError: bad width/count/dtype, or a buffer shorter than the stream.
    """
    width = _check_width(width)
    if count < 0:
        raise ValueError(f"count must be ≥ 0, got {count}")
    dt = _output_dtype(width, int(offset), dtype)
    data = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1)
    if data.dtype != np.uint8:
        raise ValueError(f"unpack_bits needs a uint8 buffer, got dtype {data.dtype}")
    need = packed_size(count, width)
    if data.size < need:
        raise ValueError(f"buffer has {data.size} bytes, {count} values of {width} bits need {need}")
    out = np.empty(count, dtype=dt)
    if width in (16, 32):
        unpack_aligned(data, width, count, int(offset), out)
        return out
    done = 0
    if width in (1, 2, 4, 8):
        unpack_pow2(data, width, count, int(offset), out)
        done = (count // (8 // width)) * (8 // width)
    elif width <= 8:
        unpack_small(data, width, count, int(offset), out)
        done = (count // 8) * 8
    unpack_stream(data[:need], done, width, count, int(offset), out)
    return out
