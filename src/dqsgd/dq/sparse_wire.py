"""Wire format of a sparse LP message (:class:`dqsgd.dq.sparse.SparseLP`), version 1 [OC].

The project codec (:mod:`dqsgd.codecs.wire`) carries dense tensors only: its ELIAS body writes
ω(|code|) per value, not the b-bit values Sparse-AsyLPG sends (docs/algorithms.md §9.3), so this format
is our own. It reuses the codec's pieces: the Elias-omega stream (:func:`~dqsgd.codecs.elias_encode`
/ :func:`~dqsgd.codecs.elias_decode`) for the index gaps, :func:`~dqsgd.codecs.pack_bits` for
fixed-width fields, and :class:`~dqsgd.codecs.PayloadError` for every refusal.

All integers little-endian::

    offset  size  field
    0       2     magic b"DS"
    2       1     version (u8) = 1
    3       1     bits b (u8), 2..16
    4       1     index coding (u8): 0 FIXED, 1 ELIAS
    5       4     d (u32)
    9       4     count k (u32) ≤ d: number of non-zero codes sent
    13      4     δ (f32), finite, ≥ 0; δ = 0 iff k = 0
    17      4     index section length L (u32)
    21      L     index section
    21+L    V     value section, V = ⌈k·w_v/8⌉ (w_v below)
    end−4   4     crc32 (u32): zlib.crc32 of every byte before it

Index section and values, by index coding (c_j: the codes in increasing index order):

* FIXED: pack_bits of the k indices at w = max(1, ⌈log2 d⌉) bits (strictly increasing, < d);
  values: pack_bits of c_j + 2^(b−1) at w_v = b bits (offset binary, as the codec's FIXED body).
* ELIAS: the codec's Elias stream of the d-vector sgn(c) ∈ {−1, 0, +1}: ω(k+1), then per code
  ω(index gap) ∥ sign bit ∥ ω(1) = "0" (so the sign rides in the stream and the only waste is the
  one-bit ω(1)); values: pack_bits of |c_j| − 1 at w_v = b − 1 bits (none when b = 2, where
  |c_j| = 1 always).

Value information is b bits per code either way. The encoder writes whichever coding is smaller
(FIXED on a tie); both sizes are exact before encoding. Canonical: every valid payload re-encodes
to the same bytes (tested), and the decoder refuses truncation, extension, bit flips (crc), zero
or out-of-range codes, unsorted or out-of-range indices, non-zero padding and foreign magic.
"""

from __future__ import annotations

import enum
import math
import struct
import zlib

import numpy as np
import torch

from dqsgd.codecs import EliasError, PayloadError, elias_bit_length, elias_decode, elias_encode
from dqsgd.codecs import pack_bits, packed_size, unpack_bits
from dqsgd.codecs.header import MAX_NUMEL
from dqsgd.dq.sparse import SparseLP
from dqsgd.quantizers import levels_for_bits

__all__ = ["IndexCoding", "encode_sparse", "decode_sparse", "sparse_size", "index_width", "HEADER_SIZE"]

MAGIC = b"DS"
VERSION = 1
_HEAD = struct.Struct("<2sBBBIIfI")
HEADER_SIZE = _HEAD.size  # 21
CRC_SIZE = 4
MIN_BITS, MAX_BITS = 2, 16


class IndexCoding(enum.IntEnum):
    FIXED = 0
    ELIAS = 1


def index_width(d: int) -> int:
    """⌈log2 d⌉ bits per index (at least 1)."""
    return max(1, (d - 1).bit_length())


def _value_width(bits: int, coding: IndexCoding) -> int:
    return bits if coding == IndexCoding.FIXED else bits - 1 if bits > 2 else 0


def _signs(msg: SparseLP) -> np.ndarray:
    s = np.zeros(msg.d, dtype=np.int8)
    s[msg.indices.numpy()] = np.sign(msg.codes.numpy()).astype(np.int8)
    return s


def _section_sizes(msg: SparseLP) -> dict[IndexCoding, tuple[int, int]]:
    """(index section bytes, value section bytes) per coding."""
    k = msg.count
    fixed = (packed_size(k, index_width(msg.d)), packed_size(k, msg.bits))
    elias = ((elias_bit_length(_signs(msg)) + 7) // 8, packed_size(k, _value_width(msg.bits, IndexCoding.ELIAS)))
    return {IndexCoding.FIXED: fixed, IndexCoding.ELIAS: elias}


def sparse_size(msg: SparseLP) -> dict[str, int]:
    """Exact payload bytes of both codings (what :func:`encode_sparse` chooses between)."""
    return {c.name: HEADER_SIZE + i + v + CRC_SIZE for c, (i, v) in _section_sizes(msg).items()}


def _validate(msg: SparseLP) -> None:
    if not MIN_BITS <= msg.bits <= MAX_BITS:
        raise ValueError(f"sparse message: bits must be in [{MIN_BITS}, {MAX_BITS}], got {msg.bits}")
    if not 1 <= msg.d < 1 << 32 or msg.count > msg.d:
        raise ValueError(f"sparse message: need 1 ≤ d < 2^32 and count ≤ d, got d={msg.d}, count={msg.count}")
    if not (math.isfinite(msg.delta) and msg.delta >= 0) or (msg.delta == 0) != (msg.count == 0):
        raise ValueError(f"sparse message: δ must be finite, ≥ 0, and 0 exactly when nothing is sent (δ={msg.delta})")
    try:
        as_f32 = struct.unpack("<f", struct.pack("<f", msg.delta))[0]
    except OverflowError:
        as_f32 = math.inf
    if as_f32 != msg.delta:
        raise ValueError(f"sparse message: δ={msg.delta!r} is not a float32 value")
    idx, codes = msg.indices, msg.codes
    if idx.dtype != torch.int64 or codes.dtype != torch.int32 or idx.numel() != codes.numel():
        raise ValueError("sparse message: indices must be int64 and codes int32 of the same length")
    top = levels_for_bits(msg.bits)
    if msg.count and (int(idx[0]) < 0 or int(idx[-1]) >= msg.d or bool((idx[1:] <= idx[:-1]).any())):
        raise ValueError("sparse message: indices must be strictly increasing and in [0, d)")
    if msg.count and (bool((codes == 0).any()) or int(codes.abs().max()) > top):
        raise ValueError(f"sparse message: codes must be non-zero with |c| ≤ {top}")


def encode_sparse(msg: SparseLP, coding: IndexCoding | None = None) -> bytes:
    """Bytes of ``msg``; ``coding=None`` picks the smaller index coding (FIXED on a tie)."""
    _validate(msg)
    sizes = _section_sizes(msg)
    if coding is None:
        coding = min(IndexCoding, key=lambda c: (sum(sizes[c]), c))
    k, codes = msg.count, msg.codes.numpy()
    if coding == IndexCoding.FIXED:
        index = pack_bits(msg.indices.numpy(), index_width(msg.d))
        values = pack_bits(codes, msg.bits, offset=1 << (msg.bits - 1))
    else:
        index = elias_encode(_signs(msg))
        w = _value_width(msg.bits, coding)
        values = pack_bits(np.abs(codes) - 1, w) if w else np.zeros(0, dtype=np.uint8)
    head = _HEAD.pack(MAGIC, VERSION, msg.bits, int(coding), msg.d, k, msg.delta, len(index))
    body = head + index.tobytes() + values.tobytes()
    return body + struct.pack("<I", zlib.crc32(body))


def _check_padding(section: memoryview, nbits: int, where: str) -> None:
    tail = nbits % 8
    if tail and section[-1] >> tail:
        raise PayloadError(f"non-zero padding bits at the end of the {where} section")


def decode_sparse(payload: bytes | bytearray | memoryview, *, max_d: int = MAX_NUMEL) -> SparseLP:
    """Parse and validate; the inverse of :func:`encode_sparse`.

    Raises:
      PayloadError: for anything :func:`encode_sparse` could not have produced.
    """
    buf = memoryview(payload).cast("B")
    if len(buf) < 2 or bytes(buf[:2]) != MAGIC:
        raise PayloadError(f"not a sparse dqsgd message: magic {bytes(buf[:2])!r}, expected {MAGIC!r}")
    if len(buf) < HEADER_SIZE + CRC_SIZE:
        raise PayloadError(f"sparse message truncated: {len(buf)} bytes, the header alone needs {HEADER_SIZE + CRC_SIZE}")
    _, version, bits, coding_b, d, k, delta, ilen = _HEAD.unpack(buf[:HEADER_SIZE])
    if version != VERSION:
        raise PayloadError(f"sparse message version {version}, this dqsgd reads {VERSION}")
    if not MIN_BITS <= bits <= MAX_BITS or coding_b not in (0, 1):
        raise PayloadError(f"sparse message: bits {bits} or index coding {coding_b} out of range")
    if not 1 <= d <= max_d or k > d:
        raise PayloadError(f"sparse message: d={d} (max {max_d}) or count={k} > d")
    if not (math.isfinite(delta) and delta >= 0) or (delta == 0) != (k == 0):
        raise PayloadError(f"sparse message: δ={delta} invalid for count {k}")
    coding = IndexCoding(coding_b)
    wv = _value_width(bits, coding)
    vlen = packed_size(k, wv)
    if len(buf) != HEADER_SIZE + ilen + vlen + CRC_SIZE:
        raise PayloadError(f"sparse message: {len(buf)} bytes, the header says {HEADER_SIZE + ilen + vlen + CRC_SIZE}")
    if zlib.crc32(buf[:-CRC_SIZE]) != int.from_bytes(buf[-CRC_SIZE:], "little"):
        raise PayloadError("sparse message: crc mismatch")
    isec = buf[HEADER_SIZE:HEADER_SIZE + ilen]
    vsec = buf[HEADER_SIZE + ilen:HEADER_SIZE + ilen + vlen]
    _check_padding(vsec, k * wv, "value")
    parse = _parse_fixed if coding == IndexCoding.FIXED else _parse_elias
    idx, codes = parse(isec, vsec, d, k, bits)
    return SparseLP(d, bits, delta, torch.from_numpy(idx), torch.from_numpy(codes))


def _parse_fixed(isec: memoryview, vsec: memoryview, d: int, k: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    w, top = index_width(d), levels_for_bits(bits)
    if len(isec) != packed_size(k, w):
        raise PayloadError(f"sparse message: index section of {len(isec)} bytes, {k} indices need {packed_size(k, w)}")
    _check_padding(isec, k * w, "index")
    idx = unpack_bits(isec, w, k, dtype=np.int64)
    codes = unpack_bits(vsec, bits, k, offset=1 << (bits - 1), dtype=np.int32)
    if k and (idx[-1] >= d or np.any(np.diff(idx) <= 0)):
        raise PayloadError("sparse message: indices not strictly increasing or ≥ d")
    if k and (np.any(codes == 0) or np.abs(codes).max() > top):
        raise PayloadError(f"sparse message: codes must be non-zero with |c| ≤ {top}")
    return idx, codes


def _parse_elias(isec: memoryview, vsec: memoryview, d: int, k: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    wv, top = _value_width(bits, IndexCoding.ELIAS), levels_for_bits(bits)
    try:
        signs, nnz = elias_decode(isec, d, min_code=-1, max_code=1)
    except EliasError as e:
        raise PayloadError(f"sparse message: Elias index section: {e}") from None
    if nnz != k:
        raise PayloadError(f"sparse message: Elias section has {nnz} indices, the header says {k}")
    idx = np.flatnonzero(signs).astype(np.int64)
    mags = unpack_bits(vsec, wv, k, dtype=np.int32) + 1 if wv else np.ones(k, dtype=np.int32)
    if k and mags.max() > top:
        raise PayloadError(f"sparse message: magnitude {int(mags.max())} > {top}")
    return idx, (mags * signs[idx]).astype(np.int32)
