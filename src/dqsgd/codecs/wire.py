"""Quantized tensor ⇄ the bytes that cross the network (payload format version 2; reads version 1).

A payload is ``header ∥ body ∥ crc32`` (header layout: :mod:`dqsgd.codecs.header`)::

    magic "DQ" | version u8 | scheme u8 | bits u8 | coding u8 | norm u8 | ndim u4 + dtype u4 | levels u32
    | dims u32×ndim | layout kind u8 [| bucket u32 | count u32, sizes u32×count] | scales f32×nseg
    | body length u32 | body | crc32 u32 (zlib.crc32 of everything before it)

Bodies, by coding (b = bits, n = numel):

* FIXED: ``pack_bits`` of u_i, exactly ⌈n·b/8⌉ bytes, padding bits zero.  b ≥ 2: offset binary
  ``u = code + 2^(b−1)``; b = 1: codes are ±1 and ``u = 1 if code > 0 else 0``.
  IDENTITY and SKETCH (a count sketch's table): the raw float32 values, little-endian (b = 32).
* ELIAS: the Elias-omega stream of :mod:`dqsgd.codecs.elias` (integer schemes only).
* ZSTD: one zstd frame (level 3) of the FIXED body, content size in the frame header.
* ZSTD_ALIGNED: one zstd frame (level 3) of the codes packed as FIXED but at the width
  A = min{1, 2, 4, 8, 16, 32 ≥ b} (:func:`body_width`): u_i as above (offset 2^(b−1)), in an A-bit
  field whose high A − b bits are zero, so no code straddles a byte and zstd's byte-wise literal
  coder sees whole codes (b = 6: one code per byte). Same as ZSTD when b is already 1, 2, 4, 8
  or 16. On a LeNet/MNIST gradient at b = 3, 5, 6, 7 it was 10-27% smaller than ZSTD, and on
  Gaussian vectors at b = 6 within 2% of the levels' entropy (``dqsgd bench codec``).
* RANS: static order-0 rANS of the offset-binary codes (:mod:`dqsgd.codecs.rans`: a table of the
  symbols that occur and their frequencies out of 2^16, the 32-bit final state, the byte stream;
  empty for n = 0). Integer schemes only. Within ~0.1% of the levels' empirical entropy plus the
  table (a few bytes per distinct level), so it is the one that approaches the entropy on sparse
  gradients, where zstd's literals cannot go below ~1 bit per code.
* RANSX: RANS's table, then 8 interleaved 64-bit rANS states and a stream of 32-bit words
  (:mod:`dqsgd.codecs.ransx`); integer schemes only. Up to 60 bytes more than RANS (the states),
  about twice as fast to decode.
* AUTO (encode only): the smallest of FIXED, ELIAS, ZSTD_ALIGNED and RANS (RANSX from 2^16 codes on;
  ties: in that order),
  found from size bounds so that only the winner is coded (:mod:`dqsgd.codecs.auto`); with a link
  rate, the one with the least modelled time instead.

Which codes are valid (checked on encode and decode): width b = 1 allows {−1, +1}, b ≥ 2 allows
[−2^(b−1), 2^(b−1) − 1]; within that UNIFORM needs |c| ≤ levels, SIGN c ∈ {−1, +1}, TERNARY
c ∈ {−1, 0, +1}, LOWPREC any.  Integer schemes need 1 ≤ b ≤ 16 and levels ≥ 1; the raw schemes
(IDENTITY, SKETCH) b = 32, no codes and no scales.  Every decoded payload re-encodes to the same bytes (FIXED, ELIAS, RANS, RANSX; ZSTD
frames are validated but only their content is canonical; with the same zstd library the bytes
are the same too).  The crc of big payloads is computed on several threads
(:func:`dqsgd.codecs.threads.crc32`: the same value).
"""

from __future__ import annotations

import math
import struct
from typing import Callable, Sequence

import numpy as np
import torch

from dqsgd.codecs.auto import smallest_body
from dqsgd.codecs.bodies import fixed_body, zstandard_module, zstd_compress
from dqsgd.codecs.bitpack import packed_size, unpack_bits
from dqsgd.codecs.bounds import body_width, check_body_can_hold, check_zstd_can_hold
from dqsgd.codecs.elias import EliasError, elias_decode, elias_encode
from dqsgd.codecs.header import (
    MAX_NUMEL, U32_MAX, Coding, Header, MAX_NDIM, PayloadError, dtype_code, header_size, layout_segments, parse_header,
    write_header,
)
from dqsgd.codecs.rans import RansError, level_histogram, rans_decode, rans_encode
from dqsgd.codecs.ransx import ransx_decode_uncounted, ransx_encode
from dqsgd.codecs.header import (  # noqa: F401 - MAX_CODE_BITS and scheme_error: also wire.*
    MAX_CODE_BITS, code_range, histogram_range_error, range_error, scheme_error,
)
from dqsgd.codecs.threads import crc32
from dqsgd.quantizers.base import RAW_SCHEMES, Layout, Norm, Quantized, Scheme

__all__ = ["Coding", "PayloadError", "body_width", "coded_size", "decode", "encode", "header_size", "predicted_size"]

# zstd clamps a frame's window to its declared content size (which must equal the expected size);
# level-3 frames use windows ≤ 2 MiB, so this cap only refuses frames dqsgd never writes.
_ZSTD_MAX_WINDOW = 1 << 23


# ---------------------------------------------------------------------------------------- encode


def _as_numpy(t: torch.Tensor, dtype: torch.dtype, size: int, what: str) -> np.ndarray:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1 or t.numel() != size:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what} must be a 1-D {dtype} tensor of {size} elements, got {got}")
    return t.detach().cpu().contiguous().numpy()


def check_layout(layout: Layout, numel: int) -> int:
    """Validate a layout for the wire; return its number of segments."""
    if layout.sizes is not None:
        if len(layout.sizes) > U32_MAX or any(not 0 <= s <= U32_MAX for s in layout.sizes):
            raise ValueError("layout sizes must each fit in u32 (and be ≥ 0)")
        if sum(layout.sizes) != numel:
            raise ValueError(f"layout sizes sum to {sum(layout.sizes)}, tensor has {numel} elements")
        return len(layout.sizes)
    if not 0 <= layout.bucket <= U32_MAX:
        raise ValueError(f"bucket must be in 0..2^32-1, got {layout.bucket}")
    return layout_segments(layout, numel)


def _validated(q: Quantized, hist: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Check everything the wire needs; return (codes, or values for IDENTITY; scales). ``hist``:
    the codes' level histogram, which the range check then reads instead of the codes."""
    scheme = Scheme(q.scheme)
    if len(q.shape) > MAX_NDIM or any(not 0 <= int(d) <= U32_MAX for d in q.shape):
        raise ValueError(f"shape {tuple(q.shape)}: need ndim ≤ {MAX_NDIM} and every dim in 0..2^32-1")
    if (err := scheme_error(scheme, q.bits, q.levels)) is not None:
        raise ValueError(err)
    if not 0 <= q.levels <= U32_MAX:
        raise ValueError(f"levels must be in 0..2^32-1, got {q.levels}")
    numel = q.numel
    nseg = check_layout(q.layout, numel)
    dtype_code(q.dtype)  # the header can restore it
    if scheme in RAW_SCHEMES:
        nseg = 0  # raw values carry no scales
        if q.values is None:
            raise ValueError(f"{scheme.name} needs values")
        _as_numpy(q.codes, torch.int32, 0, f"{scheme.name} codes")
        data = _as_numpy(q.values, torch.float32, numel, "values")
        if data.size and not np.isfinite(data).all():
            raise ValueError(f"{scheme.name} values contain NaN or Inf; refusing to encode (decode would refuse them too)")
    else:
        data = _as_numpy(q.codes, torch.int32, numel, "codes")
        rng = code_range(scheme, q.bits, q.levels)
        if (err := range_error(data, rng) if hist is None else histogram_range_error(hist, numel, q.bits, rng)):
            raise ValueError(f"{scheme.name} at {q.bits} bits, levels {q.levels}: {err}")
    if isinstance(q.scales, torch.Tensor) and q.scales.dim() == 1 and q.scales.numel() != nseg:
        raise ValueError(f"{q.scales.numel()} scales, but the layout has {nseg} segments for {numel} elements"
                         + (f" ({scheme.name} carries no scales)" if scheme in RAW_SCHEMES else ""))
    scales = _as_numpy(q.scales, torch.float32, nseg, "scales")
    if not np.isfinite(scales).all():
        raise ValueError("scales must be finite")
    return data, scales


def _body(data: np.ndarray, bits: int, coding: Coding, scheme: Scheme, link_mbit: float = 0.0,
          hist: np.ndarray | None = None) -> tuple[Coding, bytes | np.ndarray]:
    if scheme in RAW_SCHEMES and coding in (Coding.ELIAS, Coding.RANS, Coding.RANSX):
        raise ValueError(f"{scheme.name} payloads cannot use {coding.name} coding (no integer codes)")
    if coding == Coding.AUTO:
        return smallest_body(data, bits, scheme not in RAW_SCHEMES, link_mbit, hist)
    if coding == Coding.ELIAS:
        return coding, elias_encode(data)
    if coding == Coding.RANS:
        return coding, rans_encode(data, bits, hist)
    if coding == Coding.RANSX:
        return coding, ransx_encode(data, bits, hist)
    fixed = fixed_body(data, bits, body_width(bits, coding))
    if coding in (Coding.ZSTD, Coding.ZSTD_ALIGNED):
        return coding, zstd_compress(fixed)
    return coding, fixed


def _smallest_body(data: np.ndarray, bits: int, scheme: Scheme) -> tuple[Coding, bytes | np.ndarray]:
    """AUTO: the smallest of FIXED, ELIAS, ZSTD_ALIGNED and RANS (ties go to the earlier one), from
    size bounds first: only the winner is written (:mod:`dqsgd.codecs.auto`)."""
    return smallest_body(data, bits, scheme not in RAW_SCHEMES)


def encode(q: Quantized, coding: Coding = Coding.FIXED, *, link_mbit: float = 0.0,
           histogram: np.ndarray | None = None) -> bytes:
    """The payload of ``q`` (format in the module docstring).

    ``link_mbit`` (AUTO only): > 0 picks the coding whose modelled encode + decode time plus the
    payload's time on a link of that many Mbit/s is least (:mod:`dqsgd.codecs.auto`), not the smallest.
    ``histogram`` (integer schemes): the codes' :func:`~dqsgd.codecs.rans.level_histogram`, where the
    caller counted it already (the fused quantizer does, in its pass): the codes' range is checked
    from it, and AUTO and the rANS codings use it instead of counting again. The bytes are the same;
    a histogram that is not the codes' gives a wrong body (a decoder refuses it), so only a caller
    that computed it from these codes passes it.

    Raises:
      ValueError: an unknown coding, or a Quantized the wire cannot carry exactly (bad dtype or
        length, codes outside the scheme's range, non-finite scales, bits out of range, …).
    """
    try:
        coding = Coding(coding)
    except ValueError:
        raise ValueError(f"unknown coding {coding!r}") from None
    if not (math.isfinite(link_mbit) and link_mbit >= 0):
        raise ValueError(f"link_mbit must be a finite rate ≥ 0 (0: by size), got {link_mbit!r}")
    scheme = Scheme(q.scheme)
    hist = None if histogram is None or scheme in RAW_SCHEMES else np.asarray(histogram, dtype=np.int64)
    data, scales = _validated(q, hist)
    used, body = _body(data, q.bits, coding, scheme, link_mbit, hist)
    if memoryview(body).nbytes > U32_MAX:
        raise ValueError(f"body of {memoryview(body).nbytes} bytes exceeds the u32 body length field")
    shape = tuple(int(d) for d in q.shape)
    layout = q.layout if q.layout.sizes is None else Layout(sizes=tuple(int(s) for s in q.layout.sizes))
    head = write_header(scheme, q.bits, used, Norm(q.norm), q.levels, shape, layout, scales, memoryview(body).nbytes,
                        dtype=q.dtype)
    crc = crc32(body, crc32(head))
    return b"".join((head, body, struct.pack("<I", crc)))


def predicted_size(
    numel: int, bits: int, num_segments: int, ndim: int, layout: Layout, coding: Coding = Coding.FIXED
) -> int:
    """Exact length of a FIXED payload: header + ⌈numel·bits/8⌉ + 4 (crc).

    ``num_segments`` is the number of scales (0 for IDENTITY, whose bits are 32).  Only FIXED
    sizes are known before encoding; ELIAS, ZSTD, ZSTD_ALIGNED, RANS and AUTO depend on the codes
    (the ledger records the real bytes of those).
    """
    if Coding(coding) != Coding.FIXED:
        raise ValueError(f"only FIXED payload sizes are predictable, not {Coding(coding).name}")
    return header_size(ndim, layout, num_segments) + packed_size(numel, bits) + 4


# ---------------------------------------------------------------------------------------- decode


def read_header(payload: bytes | bytearray | memoryview, *, max_numel: int = MAX_NUMEL,
                numel: int | None = None) -> Header:
    """Parse a payload's header and check its crc: everything :func:`decode` checks before the body."""
    buf = memoryview(payload).cast("B")
    h = parse_header(buf, max_numel, numel)
    check_parsed(h, buf[h.body_start : h.body_start + h.body_len], buf)
    return h


def check_parsed(h: Header, body: Sequence[int], whole: memoryview | None = None) -> None:
    """What every decoder checks of a parsed header before it allocates for its numel (the host's
    :func:`read_header`, the device decoder's header read): the scheme's bits and levels, ELIAS's
    count, the crc of the ``whole`` payload (where it is on the host; the device checks its own),
    and what a ``body`` of its length can carry (:func:`~dqsgd.codecs.bounds.check_body_can_hold`:
    a FIXED body's exact length)."""
    if (err := scheme_error(h.scheme, h.bits, h.levels)) is not None:
        raise PayloadError(f"{err} (header offset 4)")
    if h.numel >= U32_MAX and h.coding == Coding.ELIAS:
        raise PayloadError(f"ELIAS payloads carry < 2^32 - 1 elements, this one declares {h.numel}")
    if whole is not None:
        check_crc(whole)
    check_body_can_hold(body, h, h.body_start)


def check_crc(buf: memoryview) -> None:
    """Refuse a payload whose last 4 bytes are not the crc32 (little-endian) of the bytes before them."""
    stored, computed = int.from_bytes(buf[-4:], "little"), crc32(buf[:-4])
    if computed != stored:
        raise PayloadError(f"crc mismatch: stored {stored:#010x} at offset {len(buf) - 4}, computed {computed:#010x}")


def _unpack_fixed(body: memoryview, h: Header, offset: int, width: int) -> np.ndarray:
    numel, bits = h.numel, h.bits
    need = packed_size(numel, width)
    if len(body) != need:
        raise PayloadError(f"body at offset {offset} has {len(body)} bytes, {numel}×{width} bits need {need}")
    tail = (numel * width) % 8
    if tail and body[-1] >> tail:
        raise PayloadError(f"non-zero padding bits in the last body byte (offset {offset + len(body) - 1})")
    if bits == 32:
        return np.frombuffer(body, dtype="<f4").astype(np.float32)
    if bits == 1:
        codes = unpack_bits(body, width, numel, dtype=np.int32)
        codes *= 2
        codes -= 1
        return codes
    return unpack_bits(body, width, numel, offset=1 << (bits - 1), dtype=np.int32)


def unzstd(body: memoryview, expected: int, offset: int) -> memoryview:
    """Decompress one zstd frame whose header must declare exactly ``expected`` bytes (so zstd
    itself bounds the output), with nothing after it."""
    check_zstd_can_hold(body, expected, offset)
    zstandard = zstandard_module()
    try:
        declared = zstandard.get_frame_parameters(body).content_size
        if declared != expected:
            raise PayloadError(f"zstd frame at offset {offset} declares {declared} bytes, expected {expected}")
        # One output buffer of the declared size (a decompressobj grows and joins, a transient copy).
        out = zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW).decompress(body, allow_extra_data=False)
    except zstandard.ZstdError as e:
        if "unused data" in str(e):
            raise PayloadError(f"zstd body at offset {offset}: incomplete frame or trailing data") from None
        raise PayloadError(f"corrupt zstd body at offset {offset}: {e}") from None
    if len(out) != expected:
        raise PayloadError(f"zstd body at offset {offset}: incomplete frame or trailing data")
    return memoryview(out)


def decode_body(buf: memoryview, h: Header) -> np.ndarray:
    """The codes (or raw values) of a payload's body, validated: everything :func:`decode` checks of it."""
    data, check = decode_body_uncounted(buf, h)
    if check is not None:
        check(level_histogram(data, h.bits))
    return data


def decode_body_uncounted(buf: memoryview, h: Header) -> tuple[np.ndarray, Callable[[np.ndarray], None] | None]:
    """:func:`decode_body`, except that a RANSX body's last check (its table is exactly the normalised
    counts of the decoded codes) comes back as a function of the codes'
    :func:`~dqsgd.codecs.rans.level_histogram`, raising PayloadError, for a caller that counts them in
    its own pass (decode-accumulate); None for every other body, checked whole. Until that check has
    returned the codes are not valid."""
    offset = h.body_start
    body = buf[offset : offset + h.body_len]
    check_body_can_hold(body, h, offset)
    width = body_width(h.bits, h.coding)
    if h.coding == Coding.FIXED:
        data = _unpack_fixed(body, h, offset, width)
    elif h.coding in (Coding.ZSTD, Coding.ZSTD_ALIGNED):
        data = _unpack_fixed(unzstd(body, packed_size(h.numel, width), offset), h, offset, width)
    elif h.coding in (Coding.RANS, Coding.RANSX):
        if h.scheme in RAW_SCHEMES:
            raise PayloadError(f"{h.scheme.name} payload with {h.coding.name} coding (offset 5)")
        rng = code_range(h.scheme, h.bits, h.levels)
        try:
            if h.coding == Coding.RANS:
                return rans_decode(body, h.numel, h.bits, rng.lo, rng.hi, rng.zero_ok), None
            codes, check = ransx_decode_uncounted(body, h.numel, h.bits, rng.lo, rng.hi, rng.zero_ok)
        except RansError as e:
            raise PayloadError(f"{h.coding.name} body at offset {offset}: {e}") from None

        def counted(hist: np.ndarray) -> None:
            try:
                check(hist)
            except RansError as e:
                raise PayloadError(f"{h.coding.name} body at offset {offset}: {e}") from None

        return codes, counted
    else:
        if h.scheme in RAW_SCHEMES:
            raise PayloadError(f"{h.scheme.name} payload with ELIAS coding (offset 5)")
        rng = code_range(h.scheme, h.bits, h.levels)
        try:
            data, nnz = elias_decode(body, h.numel, min_code=rng.lo, max_code=rng.hi)
        except EliasError as e:
            raise PayloadError(f"Elias body at offset {offset}: {e}") from None
        if nnz != h.numel and not rng.zero_ok:
            raise PayloadError(
                f"Elias body at offset {offset} has zero codes, which {h.scheme.name} at {h.bits} bits cannot carry"
            )
        return data, None
    if h.scheme not in RAW_SCHEMES:
        if (err := range_error(data, code_range(h.scheme, h.bits, h.levels))) is not None:
            raise PayloadError(f"body at offset {offset}: {err}")
    elif data.size and not np.isfinite(data).all():
        # encode() refuses non-finite values (the quantizers do too), so such a body is corrupt.
        raise PayloadError(f"{h.scheme.name} body at offset {offset} holds NaN or Inf values")
    return data, None


def decode(payload: bytes | bytearray | memoryview, *, max_numel: int = MAX_NUMEL,
           numel: int | None = None) -> Quantized:
    """Parse and validate a payload; the inverse of :func:`encode`.

    ``max_numel`` caps the number of elements a payload may declare; ``numel``, when the caller
    knows it, replaces the cap with an exact check. Both are checked, with every other size field
    and the bound a body of its length can carry (:mod:`dqsgd.codecs.bounds`), before anything
    is allocated.

    Raises:
      PayloadError: for any payload that :func:`encode` could not have produced (truncated,
        padded, bit-flipped, forged, foreign, or from a newer format version).
    """
    buf = memoryview(payload).cast("B")
    h = read_header(buf, max_numel=max_numel, numel=numel)
    data = decode_body(buf, h)
    empty_i = torch.zeros(0, dtype=torch.int32)
    scales = torch.from_numpy(h.scales)
    if h.scheme in RAW_SCHEMES:
        return Quantized(h.scheme, h.bits, h.levels, empty_i, scales, h.layout, h.shape, h.norm, torch.from_numpy(data),
                         h.dtype)
    return Quantized(h.scheme, h.bits, h.levels, torch.from_numpy(data), scales, h.layout, h.shape, h.norm,
                     dtype=h.dtype)


def coded_size(payload: bytes | bytearray | memoryview, *, max_numel: int = MAX_NUMEL) -> int:
    """Length of ``payload`` re-encoded with :attr:`Coding.AUTO`: the bytes its levels need with the
    best coding dqsgd has (the smallest of FIXED, ELIAS, ZSTD_ALIGNED and RANS; above 64 KiB
    zstd only where a sample says it may win: :mod:`dqsgd.codecs.auto`).

    Equal to ``len(encode(decode(payload), Coding.AUTO))``: the payload is validated and decoded
    like :func:`decode` (``max_numel`` caps the elements it may declare), and its levels, scales
    and layout are encoded again. The header has the same length under every coding, so the
    result is at most ``len(payload)`` whenever the payload's own coding is one AUTO chooses from
    (FIXED, ELIAS, ZSTD_ALIGNED, RANS or AUTO itself); only a ZSTD payload may be shorter.

    Raw (IDENTITY, SKETCH: fp32) payloads carry no levels to entropy-code: their coded size is the payload's own
    length (only the header and CRC are checked, the floats are not decoded).

    Raises:
      PayloadError: a payload :func:`decode` refuses.
    """
    buf = memoryview(payload).cast("B")
    if read_header(buf, max_numel=max_numel).scheme in RAW_SCHEMES:
        return len(buf)
    return len(encode(decode(buf, max_numel=max_numel), Coding.AUTO))
