"""Wire format of a set of coordinates, with or without fp32 values (Sketched SGD's index messages).

Sketched SGD (:mod:`dqsgd.topology.sketched`) sends its count sketches as SKETCH payloads of the project codec
and the exact values of the fetched coordinates as IDENTITY payloads; what that codec cannot carry is a
set of coordinate indices: the candidates a parameter server asks the workers for, and the sparse update
(indices and values) it sends back. This format carries those. All integers little-endian::

    offset  size  field
    0       2     magic b"DK"
    2       1     version (u8) = 1
    3       1     kind (u8): 0 INDICES (a set of coordinates), 1 SPARSE (coordinates and fp32 values)
    4       4     d (u32): the vector's length
    8       4     k (u32) ≤ d: the number of coordinates
    12      I     the k indices, strictly increasing, < d: pack_bits at w = max(1, ⌈log2 d⌉) bits,
                  I = ⌈k·w/8⌉, padding bits zero
    12+I    V     SPARSE: k float32 values, finite (V = 4k); INDICES: none
    end−4   4     crc32 (u32): zlib.crc32 of every byte before it

Exact size: 16 + ⌈k·w/8⌉ (+ 4k), :func:`index_message_size`. The decoder refuses (PayloadError) a
foreign magic, a newer version, an unknown kind, d other than the caller's, k above the caller's cap,
truncation, extension, non-zero padding, indices not strictly increasing or ≥ d, non-finite values
and a wrong crc, all before allocating more than the payload's own size.
"""

from __future__ import annotations

import enum
import struct

import numpy as np
import torch

from dqsgd.codecs.bitpack import pack_bits, packed_size, unpack_bits
from dqsgd.codecs.header import U32_MAX, PayloadError
from dqsgd.codecs.threads import crc32

__all__ = ["IndexKind", "decode_indices", "encode_indices", "index_message_size", "index_width"]

MAGIC = b"DK"
VERSION = 1
_HEAD = struct.Struct("<2sBBII")
_CRC = 4


class IndexKind(enum.IntEnum):
    INDICES = 0
    SPARSE = 1


def index_width(d: int) -> int:
    """⌈log2 d⌉ bits per index (at least 1)."""
    return max(1, (d - 1).bit_length())


def index_message_size(d: int, k: int, kind: IndexKind) -> int:
    """The exact length of a message of ``k`` of ``d`` coordinates."""
    return _HEAD.size + packed_size(k, index_width(d)) + (4 * k if kind == IndexKind.SPARSE else 0) + _CRC


def encode_indices(indices: torch.Tensor, d: int, values: torch.Tensor | None = None) -> bytes:
    """The message of ``indices`` (strictly increasing, < d) and, for a SPARSE message, their ``values``."""
    idx = indices.detach().cpu().to(torch.int64).reshape(-1).numpy()
    if not 0 <= d <= U32_MAX or idx.size > d:
        raise ValueError(f"{idx.size} indices of a vector of {d} values (d must fit in u32)")
    if idx.size and (idx[0] < 0 or idx[-1] >= d or (np.diff(idx) <= 0).any()):
        raise ValueError(f"indices must be strictly increasing and in [0, {d})")
    kind = IndexKind.INDICES if values is None else IndexKind.SPARSE
    parts = [_HEAD.pack(MAGIC, VERSION, kind, d, idx.size), pack_bits(idx, index_width(d)).tobytes()]
    if values is not None:
        v = values.detach().cpu().to(torch.float32).reshape(-1).numpy()
        if v.size != idx.size or not np.isfinite(v).all():
            raise ValueError(f"need {idx.size} finite values, got {v.size} (finite: {bool(np.isfinite(v).all())})")
        parts.append(v.astype("<f4").tobytes())
    body = b"".join(parts)
    return body + struct.pack("<I", crc32(body))


def decode_indices(payload: bytes | bytearray | memoryview, d: int, max_k: int,
                   kind: IndexKind) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(indices int64, values float32 or None) of a message of kind ``kind`` for a ``d``-vector with at
    most ``max_k`` coordinates."""
    buf = memoryview(payload).cast("B")
    if len(buf) < _HEAD.size + _CRC:
        raise PayloadError(f"index message truncated: {len(buf)} bytes, the header and crc need {_HEAD.size + _CRC}")
    magic, version, got_kind, got_d, k = _HEAD.unpack(buf[: _HEAD.size])
    if magic != MAGIC:
        raise PayloadError(f"not an index message: magic {bytes(magic)!r} at offset 0, expected {MAGIC!r}")
    if version != VERSION:
        raise PayloadError(f"index message version {version} at offset 2; this dqsgd reads version {VERSION}")
    if got_kind != kind:
        raise PayloadError(f"index message of kind {got_kind} at offset 3, expected {int(kind)} ({kind.name})")
    if got_d != d or k > min(max_k, d):
        raise PayloadError(f"index message of {k} coordinates of d = {got_d} (offsets 4, 8); expected d = {d}, "
                           f"at most {min(max_k, d)} coordinates")
    if len(buf) != index_message_size(d, k, kind):
        raise PayloadError(f"index message of {len(buf)} bytes; {k} coordinates of d = {d} take "
                           f"{index_message_size(d, k, kind)}")
    stored, computed = int.from_bytes(buf[-4:], "little"), crc32(buf[:-4])
    if stored != computed:
        raise PayloadError(f"crc mismatch: stored {stored:#010x} at offset {len(buf) - 4}, computed {computed:#010x}")
    return _indices(buf, d, k), _values(buf, d, k) if kind == IndexKind.SPARSE else None


def _indices(buf: memoryview, d: int, k: int) -> torch.Tensor:
    w, start = index_width(d), _HEAD.size
    section = buf[start : start + packed_size(k, w)]
    tail = (k * w) % 8
    if tail and section[-1] >> tail:
        raise PayloadError(f"non-zero padding bits in the index section (offset {start + len(section) - 1})")
    idx = unpack_bits(section, w, k, dtype=np.int64)
    if k and (idx[-1] >= d or (np.diff(idx) <= 0).any()):
        raise PayloadError(f"indices at offset {start} are not strictly increasing in [0, {d})")
    return torch.from_numpy(idx)


def _values(buf: memoryview, d: int, k: int) -> torch.Tensor:
    start = _HEAD.size + packed_size(k, index_width(d))
    v = np.frombuffer(buf[start : start + 4 * k], dtype="<f4").astype(np.float32)
    if not np.isfinite(v).all():
        raise PayloadError(f"non-finite value in the values at offset {start}")
    return torch.from_numpy(v)
