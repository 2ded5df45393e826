"""The self-describing header of a dqsgd payload (format version 2; version 1 still decodes), and its errors.

All integers little-endian; offsets in bytes (``D = 4·ndim``, ``S`` = layout extra bytes)::

    offset        size       field
    0             2          magic b"DQ"
    2             1          version (u8) = 2 (1: the same layout, without the dtype nibble)
    3             1          scheme (u8): Scheme (0 identity, 1 uniform, 2 sign, 3 ternary, 4 lowprec)
    4             1          bits (u8): code width; 1..16 for integer schemes, 32 for identity
    5             1          coding (u8): 0 FIXED, 1 ELIAS, 2 ZSTD, 4 ZSTD_ALIGNED, 5 RANS, 6 RANSX (AUTO, 3, is never written)
    6             1          norm (u8): Norm (0 none, 1 l1-mean, 2 l2, 255 max)
    7             1          ndim (low 4 bits) ≤ 8 | dtype (high 4 bits, version 2): the dtype of the
                             tensor that was encoded, which decode restores: 0 float32, 1 float16,
                             2 bfloat16, 3 float64 (version 1 has no dtype: float32, high bits 0)
    8             4          levels (u32)
    12            D          dims (u32 × ndim); numel = Π dims (1 for ndim = 0)
    12+D          1          layout kind (u8): 0 one segment, 1 fixed bucket, 2 explicit sizes
    13+D          S          kind 0: nothing (S = 0); kind 1: bucket (u32, > 0) (S = 4);
                             kind 2: count (u32), sizes (u32 × count), Σ sizes = numel (S = 4 + 4·count)
    13+D+S        4·nseg     scales (f32 × nseg); nseg = segments of the layout, 0 for identity
    13+D+S+4nseg  4          body length L (u32)
    17+D+S+4nseg  L          body (see ``dqsgd.codecs.wire``)
    end − 4       4          crc32 (u32): zlib.crc32 of every byte before it

The dtype shares the ndim byte so that version 2 payloads have exactly the size of version 1
payloads (every predicted and ledgered byte count stays what it was); a float32 payload differs
from its version 1 form only in the version byte and the crc.

Parsing is bounded: each field is checked against the bytes that remain before it is read, and
``numel`` against the caller's ``max_numel``, so forged sizes are refused before anything is
allocated.  Segment counts are computed arithmetically, never by materialising the layout.

**Code ranges** (:func:`code_range`, :func:`top_code`, :func:`range_error`). Which codes a payload may
carry: the range of a (scheme, bits, levels), checked on encode and decode. Width b = 1 allows {−1, +1},
b ≥ 2 allows [−2^(b−1), 2^(b−1) − 1]; within that UNIFORM needs |c| ≤ levels, SIGN c ∈ {−1, +1}, TERNARY
c ∈ {−1, 0, +1}, LOWPREC any (:mod:`dqsgd.codecs.wire`). The check reads the codes (:func:`range_error`,
one compiled pass) or, where the encoder's caller counted them already, their level histogram
(:func:`histogram_range_error`, no pass).
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from dqsgd.quantizers.base import RAW_SCHEMES, Layout, Norm, Scheme

__all__ = [
    "DTYPES", "MAX_NUMEL", "Coding", "Header", "MAGIC", "PayloadError", "VERSION",
    "dtype_code", "header_size", "layout_segments", "parse_header", "write_header",
    "MAX_CODE_BITS", "code_range", "histogram_range_error", "range_error", "scheme_error", "top_code",
]

MAGIC = b"DQ"
VERSION = 2
OLDEST_VERSION = 1  # version 1: no dtype (float32)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # index = the dtype code
MAX_NDIM = 8
MAX_NUMEL = 1 << 28  # the codec's default cap on the elements a payload may declare (1 GiB of float32)
U32_MAX = (1 << 32) - 1
_FIELDS = struct.Struct("<BBBBBI")  # scheme .. levels, after magic and version
_FIXED_PART_SIZE = 3 + _FIELDS.size  # 12 bytes
_LAYOUT_ONE, _LAYOUT_BUCKET, _LAYOUT_SIZES = 0, 1, 2


class PayloadError(ValueError):
    """A payload that is not a valid dqsgd message (truncated, corrupted, forged or foreign)."""


class Coding(enum.IntEnum):
    """How the body carries the codes (one byte in the header)."""

    FIXED = 0  # bit-packed offset-binary codes, ⌈numel·bits/8⌉ bytes
    ELIAS = 1  # QSGD's Elias-omega stream of the non-zero codes
    ZSTD = 2  # zstd (level 3) of the FIXED body
    AUTO = 3  # encode only: the smallest of FIXED, ELIAS, ZSTD_ALIGNED and RANS/RANSX; the header records which
    ZSTD_ALIGNED = 4  # zstd (level 3) of the codes packed at a byte-aligned width (1, 2, 4, 8, 16 ≥ bits)
    RANS = 5  # static order-0 rANS of the codes (dqsgd.codecs.rans): within ~0.1% of their entropy + a table
    RANSX = 6  # RANS's table, 8 interleaved 64-bit rANS states (dqsgd.codecs.ransx): about 2x faster to decode

    @classmethod
    def from_name(cls, name: str) -> Coding:
        """``"fixed"``, ``"elias"``, ``"zstd"``, ``"zstd-aligned"``, ``"rans"``, ``"ransx"`` or ``"auto"``
        (case and ``-``/``_`` free)."""
        try:
            return cls[name.upper().replace("-", "_")]
        except (KeyError, AttributeError):
            raise ValueError(f"unknown coding {name!r}; use fixed, elias, zstd, zstd-aligned, rans, ransx or auto") from None


@dataclass(frozen=True)
class Header:
    """Everything the header says, already validated for structure (not for the body)."""

    scheme: Scheme
    bits: int
    coding: Coding
    norm: Norm
    levels: int
    shape: tuple[int, ...]
    layout: Layout
    scales: np.ndarray  # float32, nseg
    body_start: int
    body_len: int
    dtype: torch.dtype = torch.float32  # of the encoded tensor (version 1 payloads: float32)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def dtype_code(dtype: torch.dtype) -> int:
    """The header's code of a tensor dtype (``DTYPES.index``); other dtypes cannot be restored."""
    try:
        return DTYPES.index(dtype)
    except ValueError:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise ValueError(f"the payload carries dtypes {names}, not {dtype}") from None


def _layout_kind(layout: Layout) -> int:
    if layout.sizes is not None:
        return _LAYOUT_SIZES
    return _LAYOUT_BUCKET if layout.bucket > 0 else _LAYOUT_ONE


def _layout_extra(layout: Layout) -> int:
    kind = _layout_kind(layout)
    return 0 if kind == _LAYOUT_ONE else 4 if kind == _LAYOUT_BUCKET else 4 + 4 * len(layout.sizes or ())


def header_size(ndim: int, layout: Layout, num_segments: int) -> int:
    """Bytes before the body (the body length field included); add body and 4 crc bytes."""
    return _FIXED_PART_SIZE + 4 * ndim + 1 + _layout_extra(layout) + 4 * num_segments + 4


def count_segments(kind: int, numel: int, bucket: int, count: int) -> int:
    """Segments of a layout without building it (``Layout.segment_sizes`` would allocate)."""
    if kind == _LAYOUT_SIZES:
        return count
    if numel == 0:
        return 0
    if kind == _LAYOUT_ONE or bucket >= numel:
        return 1
    return -(-numel // bucket)


def layout_segments(layout: Layout, numel: int) -> int:
    """``layout.num_segments(numel)``, computed arithmetically."""
    return count_segments(_layout_kind(layout), numel, layout.bucket, len(layout.sizes or ()))


def write_header(
    scheme: Scheme, bits: int, coding: Coding, norm: Norm, levels: int,
    shape: tuple[int, ...], layout: Layout, scales: np.ndarray, body_len: int,
    *, dtype: torch.dtype = torch.float32,
) -> bytes:
    """The header bytes up to and including the body length (fields assumed validated; ``dtype``
    is the encoded tensor's, one of :data:`DTYPES`)."""
    ndim_dtype = len(shape) | dtype_code(dtype) << 4
    parts = [MAGIC, bytes([VERSION]), _FIELDS.pack(scheme, bits, coding, norm, ndim_dtype, levels)]
    parts.append(struct.pack(f"<{len(shape)}I", *shape))
    kind = _layout_kind(layout)
    parts.append(bytes([kind]))
    if kind == _LAYOUT_BUCKET:
        parts.append(struct.pack("<I", layout.bucket))
    elif kind == _LAYOUT_SIZES:
        sizes = layout.sizes or ()
        parts.append(struct.pack("<I", len(sizes)) + np.asarray(sizes, dtype="<u4").tobytes())
    parts.append(np.ascontiguousarray(scales, dtype="<f4").tobytes())
    parts.append(struct.pack("<I", body_len))
    return b"".join(parts)


class _Reader:
    """Bounded cursor over a payload: every read states what it needs and where."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        left = len(self.buf) - self.pos
        if n > left:
            raise PayloadError(f"payload truncated: {what} needs {n} bytes at offset {self.pos}, {left} left")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return int.from_bytes(self.take(4, what), "little")


def _enum(cls: type[enum.IntEnum], value: int, what: str, offset: int) -> enum.IntEnum:
    try:
        return cls(value)
    except ValueError:
        raise PayloadError(f"unknown {what} {value} at offset {offset}") from None


def _read_fixed(r: _Reader) -> tuple[Scheme, int, Coding, Norm, int, int, torch.dtype]:
    # Magic and version first, each as soon as its bytes are there: a foreign or newer payload
    # gets that message even when it is also too short for this version's header.
    magic = bytes(r.take(2, "magic"))
    if magic != MAGIC:
        raise PayloadError(f"not a dqsgd payload: magic {magic!r} at offset 0, expected {MAGIC!r}")
    version = r.take(1, "version")[0]
    if version > VERSION:
        raise PayloadError(f"payload format version {version} is newer than this dqsgd ({VERSION})")
    if version < OLDEST_VERSION:
        raise PayloadError(f"unknown payload format version {version} at offset 2")
    scheme, bits, coding, norm, ndim, levels = _FIELDS.unpack(r.take(_FIELDS.size, "header fields"))
    code = ndim >> 4 if version >= 2 else 0  # version 1: the whole byte is ndim (so > 8 is refused)
    ndim -= code << 4
    if code >= len(DTYPES):
        raise PayloadError(f"unknown dtype code {code} (high bits of offset 7)")
    sch = _enum(Scheme, scheme, "scheme", 3)
    cod = _enum(Coding, coding, "coding", 5)
    if cod == Coding.AUTO:
        raise PayloadError("coding AUTO (3) at offset 5 is never written to the wire")
    nrm = _enum(Norm, norm, "norm", 6)
    if ndim > MAX_NDIM:
        raise PayloadError(f"ndim {ndim} at offset 7 exceeds the maximum {MAX_NDIM}")
    return sch, bits, cod, nrm, ndim, levels, DTYPES[code]


def _read_layout(r: _Reader, numel: int) -> tuple[Layout, int]:
    at = r.pos
    kind = r.take(1, "layout kind")[0]
    if kind == _LAYOUT_ONE:
        return Layout(), count_segments(kind, numel, 0, 0)
    if kind == _LAYOUT_BUCKET:
        bucket = r.u32("bucket size")
        if bucket == 0:
            raise PayloadError(f"bucket size 0 at offset {at + 1} (one segment is layout kind 0)")
        return Layout(bucket=bucket), count_segments(kind, numel, bucket, 0)
    if kind != _LAYOUT_SIZES:
        raise PayloadError(f"unknown layout kind {kind} at offset {at}")
    count = r.u32("segment count")
    sizes = np.frombuffer(r.take(4 * count, f"{count} segment sizes"), dtype="<u4")
    total = int(sizes.sum(dtype=np.uint64))
    if total != numel:
        raise PayloadError(f"segment sizes at offset {at + 5} sum to {total}, the shape has {numel} elements")
    return Layout(sizes=tuple(sizes.tolist())), count


def _check_numel(numel: int, max_numel: int, expected: int | None) -> int:
    if expected is not None:
        if numel != expected:
            raise PayloadError(f"payload declares {numel} elements (dims at offset 12), the caller expects "
                               f"numel={expected}")
    elif numel > max_numel:
        raise PayloadError(f"payload declares {numel} elements (dims at offset 12), more than max_numel={max_numel}")
    return numel


PEEK_BYTES = _FIXED_PART_SIZE + 4 * MAX_NDIM  # enough for :func:`peek_shape` at any ndim


def peek_shape(
    prefix: bytes | memoryview, max_numel: int, numel: int | None = None,
) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) from the first ≤ :data:`PEEK_BYTES` bytes of a payload, checked like
    :func:`parse_header` checks them (the rest of the payload is not validated here): what a
    decoder needs to size its output before it has the whole payload on the host."""
    r = _Reader(memoryview(prefix).cast("B"))
    *_, ndim, _, dtype = _read_fixed(r)
    shape = tuple(struct.unpack(f"<{ndim}I", r.take(4 * ndim, f"{ndim} dims")))
    _check_numel(math.prod(shape), max_numel, numel)
    return shape, dtype


def parse_header(buf: memoryview, max_numel: int, numel: int | None = None) -> Header:
    """Read and structurally validate the header; the body is ``buf[body_start:body_start+body_len]``.

    Raises:
      PayloadError: truncation, wrong magic, newer/unknown version, unknown enum values, ndim > 8,
        numel > max_numel, numel other than ``numel`` (when given: the caller knows the size, and it
        replaces ``max_numel``), inconsistent layout, or a total length that disagrees with the body length.
    """
    r = _Reader(buf)
    scheme, bits, coding, norm, ndim, levels, dtype = _read_fixed(r)
    shape = tuple(struct.unpack(f"<{ndim}I", r.take(4 * ndim, f"{ndim} dims")))
    numel = _check_numel(math.prod(shape), max_numel, numel)
    layout, nseg = _read_layout(r, numel)
    if scheme in RAW_SCHEMES:
        nseg = 0
    at = r.pos
    scales = np.frombuffer(r.take(4 * nseg, f"{nseg} scales"), dtype="<f4").astype(np.float32)
    if not np.isfinite(scales).all():
        raise PayloadError(f"non-finite scale in the scales at offset {at}")
    body_len = r.u32("body length")
    expected = r.pos + body_len + 4
    if len(buf) < expected:
        raise PayloadError(f"payload truncated: header says {expected} bytes (body length {body_len}), got {len(buf)}")
    if len(buf) > expected:
        raise PayloadError(f"{len(buf) - expected} extra bytes after the crc at offset {expected} (padded payload)")
    return Header(scheme, bits, coding, norm, levels, shape, layout, scales, r.pos, body_len, dtype)


# --- code ranges ----------------------------------------------------------------------------------
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
    payload's values from its scales (:func:`dqsgd.quantizers.base.step_bound`)."""
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
