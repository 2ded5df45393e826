"""What a body of L bytes can carry: checked before a decoder allocates for the header's numel.

Each bound follows from the coding's format alone, so a forged element count is refused with no
allocation of its size; valid payloads never reach one (tested against the most compressible
inputs there are).
"""

from __future__ import annotations

from typing import Sequence

from dqsgd.codecs.bitpack import packed_size
from dqsgd.codecs.elias import MAX_OMEGA, omega_length
from dqsgd.codecs.header import Coding, Header, PayloadError, header_size, layout_segments
from dqsgd.codecs.rans import M, RANS_L
from dqsgd.codecs.ransx import LANES, RANSX_L
from dqsgd.quantizers.base import Layout


def body_width(bits: int, coding: Coding) -> int:
    """Bits per code in the (decompressed) body: ``bits``, or for ZSTD_ALIGNED the smallest of
    1, 2, 4, 8, 16, 32 that holds ``bits``."""
    if coding != Coding.ZSTD_ALIGNED:
        return bits
    return next(w for w in (1, 2, 4, 8, 16, 32) if w >= bits)

__all__ = ["ZSTD_MAGIC", "check_body_can_hold", "check_zstd_can_hold", "max_body_bytes", "max_payload_bytes",
           "rans_numel_bound", "ransx_numel_bound", "zstd_content_bound"]

_ZSTD_BLOCK_MAX = 1 << 17  # RFC 8878 §3.1.1.2: a block decompresses to at most 128 KiB
# After K = 1 and the symbol's varint, a one-symbol RANS body is its frequency M (varint) and the
# final state, which never moves from L: so the whole body is known from the symbol.
_ONE_SYMBOL_TAIL = bytes([0x80, 0x80, M >> 14]) + RANS_L.to_bytes(4, "little")
_ONE_SYMBOL_TAIL_X = bytes([0x80, 0x80, M >> 14]) + RANSX_L.to_bytes(8, "little") * LANES  # RANSX: every lane at L


def zstd_content_bound(frame_len: int) -> int:
    """The most bytes a zstd frame of ``frame_len`` bytes can decompress to.

    A frame is the 4-byte magic, a frame header of ≥ 2 bytes, then blocks; every block has a
    3-byte header and yields at most 128 KiB (an RLE block does that from 1 more byte). So
    ``content ≤ 2^17 · ⌊(frame_len − 6) / 3⌋`` (about 44,000 : 1).
    """
    return _ZSTD_BLOCK_MAX * max(frame_len - 6, 0) // 3


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def check_zstd_can_hold(frame: Sequence[int], content: int, offset: int) -> None:
    """Refuse a body at ``offset`` that must be a zstd frame decompressing to ``content`` bytes but
    is not a zstd frame, or is too short for that (:func:`zstd_content_bound`)."""
    if bytes(frame[:4]) != ZSTD_MAGIC:
        raise PayloadError(f"ZSTD body at offset {offset} is not a zstd frame")
    if content > zstd_content_bound(len(frame)):
        raise PayloadError(f"ZSTD body at offset {offset}: {len(frame)} bytes cannot decompress to the "
                           f"{content} bytes the header's numel needs")


def rans_numel_bound(body_len: int) -> int:
    """The most codes a RANS body of ``body_len`` bytes with ≥ 2 distinct symbols can carry.

    Every frequency is then ≤ M − 1 (M = 2^16), and decoding one symbol from a state x ≥ L = 2^23
    takes x to ``f·⌊x/M⌋ + (x mod M) − c ≤ x − ⌊x/M⌋ < x·(1 − (1 − 2^-7)/M)``, while each stream
    byte read multiplies x by less than 258 (x ≥ 128 before a read). The state starts below 2^31
    and must end at exactly L, so with S ≤ body_len − 5 stream bytes (≥ 1 table byte, 4 state bytes)
    ``n·(1 − 2^-7)/M ≤ ln 2^8 + S·ln 258``, i.e. ``n < 6·M·(S + 1) ≤ 6·M·(body_len − 4)``.
    One symbol (a constant tensor) costs no bits at all: such a body bounds nothing.
    """
    return 6 * (1 << 16) * max(body_len - 4, 0)


def ransx_numel_bound(body_len: int) -> int:
    """The most codes a RANSX body of ``body_len`` bytes with ≥ 2 distinct symbols can carry.

    As for RANS: decoding a symbol with f ≤ M − 1 from a lane's state x ≥ L = 2^31 leaves less than
    ``x·(1 − (1 − 2^-15)/M)``, and x ≥ 2^15 then, so a word read multiplies it by less than
    ``2^32·(1 + 2^-15)``. Each lane starts below 2^63 and ends at L; with S words in all,
    ``n·(1 − 2^-15)/M ≤ 8·32·ln 2 + S·(32·ln 2 + 2^-15)``, and 8 + S ≤ body_len / 4 (8-byte states,
    4-byte words), so ``n < 23·M·body_len/4 < 6·M·body_len``.
    """
    return 6 * (1 << 16) * max(body_len, 0)


def _is_one_symbol_body(body: Sequence[int], tail: bytes) -> bool:
    """``01 | varint symbol (1-3 bytes) | 80 80 04 | the states at L``: the only one-symbol RANS
    (RANSX) bodies there are."""
    g = len(body) - 1 - len(tail)
    return (1 <= g <= 3 and all(b & 0x80 for b in body[1:g]) and body[g : g + 1][0] < 0x80
            and bytes(body[1 + g :]) == tail)


def check_body_can_hold(body: Sequence[int], h: Header, offset: int) -> None:
    """Refuse, before anything of ``numel`` is allocated, a body too short for the declared numel.

    FIXED's length is exact (``⌈numel·bits/8⌉``); ZSTD is bounded by :func:`zstd_content_bound`;
    RANS by :func:`rans_numel_bound`, and a one-symbol RANS body (first byte 0x01: a constant
    tensor, no bits per code) must be exactly its table and the state L. ELIAS codes trailing zeros
    in no bits at all, so an Elias body of a few bytes can be a valid payload of any numel: only
    ``max_numel`` / ``numel`` bound those, and constant RANS tensors. ``body`` needs only ``len``
    and slicing (a lazily fetched device payload will do): only a RANS body's first bytes are read.
    """
    if h.coding == Coding.FIXED and len(body) != (need := packed_size(h.numel, h.bits)):
        raise PayloadError(f"body at offset {offset} has {len(body)} bytes, {h.numel}×{h.bits} bits need {need}")
    if h.coding in (Coding.ZSTD, Coding.ZSTD_ALIGNED):
        check_zstd_can_hold(body, packed_size(h.numel, body_width(h.bits, h.coding)), offset)
    if h.coding not in (Coding.RANS, Coding.RANSX) or not h.numel:
        return
    x = h.coding == Coding.RANSX
    name = h.coding.name
    if bytes(body[:1]) == b"\x01":
        if not _is_one_symbol_body(body, _ONE_SYMBOL_TAIL_X if x else _ONE_SYMBOL_TAIL):
            raise PayloadError(f"{name} body at offset {offset}: a one-symbol table must be followed by frequency "
                               f"{M} and the state {RANSX_L if x else RANS_L}" + (" in every lane" if x else "")
                               + ", and nothing else")
        return
    bound = (ransx_numel_bound if x else rans_numel_bound)(len(body))
    if h.numel > bound:
        raise PayloadError(f"{name} body at offset {offset}: {len(body)} bytes with two or more symbols carry "
                           f"fewer than {bound} codes, the header declares {h.numel}")


# --- the most bytes a valid payload of n elements can take ----------------------------------------
_ZSTD_SMALL = 128 << 10


def zstd_frame_bound(content: int) -> int:
    """``ZSTD_compressBound``: the most bytes libzstd writes for ``content`` bytes in one frame,
    ``content + content/256 (+ (128 KiB − content)/2048 below 128 KiB)``."""
    return content + (content >> 8) + ((_ZSTD_SMALL - content) >> 11 if content < _ZSTD_SMALL else 0)


def max_body_bytes(numel: int, bits: int, coding: Coding) -> int:
    """The most body bytes dqsgd's encoder writes for ``numel`` codes of width ``bits`` (32: raw
    float32, IDENTITY) with ``coding`` (any ``Coding`` but AUTO, which picks one of them):

    * FIXED: exactly ``⌈n·b/8⌉``; ZSTD / ZSTD_ALIGNED: :func:`zstd_frame_bound` of the FIXED body
      (at width ``A = body_width(b)`` for ZSTD_ALIGNED);
    * ELIAS: ``⌈(L(n+1) + n·(2 + L(c_max)))/8⌉`` with ``L`` the ω length and ``c_max = 2^(b−1)``
      (1 at b = 1), the largest magnitude b bits carry. The count word is ``L(nnz+1) ≤ L(n+1)``;
      an item covering a gap g costs ``L(g) + 1 + L(|c|) ≤ g·(2 + L(|c|))`` since ``L(g) ≤ 2g − 1``,
      so every element non-zero at the largest magnitude is the longest stream;
    * RANS: the table (``1 + 2K`` varints of ≤ 3 bytes, ``K ≤ min(2^b, n)`` symbols), the 4-byte
      state, and at most 2 stream bytes per code (``⌈(16 − ⌊log2 f⌋)/8⌉ ≤ 2``); 0 for n = 0;
    * RANSX: the same table, 8 states of 8 bytes, and the 4-byte words, which hold at most
      ``16 + log2(1 + 2^-15)`` bits per code (:func:`~dqsgd.codecs.ransx.ransx_size_bounds`).
    """

    coding = Coding(coding)
    if coding == Coding.AUTO:
        raise ValueError("AUTO is not a body coding: it writes one of FIXED, ELIAS, ZSTD_ALIGNED, RANS, RANSX")
    if coding in (Coding.ZSTD, Coding.ZSTD_ALIGNED):
        return zstd_frame_bound(packed_size(numel, body_width(bits, coding)))
    if coding == Coding.ELIAS:
        if bits == 32 or numel >= MAX_OMEGA:
            raise ValueError(f"ELIAS codes integer levels of < 2^32 - 1 elements (bits {bits}, numel {numel})")
        top = 1 if bits == 1 else 1 << (bits - 1)
        return (omega_length(numel + 1) + numel * (2 + omega_length(top)) + 7) // 8
    if coding == Coding.RANS:
        if bits == 32:
            raise ValueError("RANS codes integer levels, not raw float32 (bits 32)")
        return 0 if numel == 0 else 3 * (1 + 2 * min(1 << bits, numel)) + 4 + 2 * numel
    if coding == Coding.RANSX:
        if bits == 32:
            raise ValueError("RANSX codes integer levels, not raw float32 (bits 32)")
        # stream words ≤ (Σ log2(M/f) + n·log2(1 + 2^-15))/32 with log2(M/f) ≤ 16 and log2(1 + 2^-15) < 1/16384
        words = (16 * numel + numel // 16384 + 1) // 32 + 1
        return 0 if numel == 0 else 3 * (1 + 2 * min(1 << bits, numel)) + 8 * LANES + 4 * words
    return packed_size(numel, bits)


def max_payload_bytes(numel: int, bits: int, *, ndim: int = 1, layout: Layout = Layout(),
                      coding: Coding | None = None) -> int:
    """The most bytes any payload of ``numel`` elements in ``ndim`` dims at width ``bits`` (32:
    IDENTITY, raw float32 with no scales) and ``layout`` can take: header + body + 4 crc bytes.

    ``coding``: the one the receiver expects; ``None`` (or AUTO) bounds every coding the sender
    may choose (AUTO only ever writes a body no longer than FIXED's). A receiver that knows
    ``numel`` refuses any announced length above this before allocating a buffer for it; every
    payload :func:`dqsgd.codecs.encode` writes fits (``measured ≤ bound``, tested at the extremes).
    """
    if numel < 0 or not 1 <= bits <= 32:
        raise ValueError(f"need numel >= 0 and bits in 1..32, got numel {numel}, bits {bits}")
    nseg = 0 if bits == 32 else layout_segments(layout, numel)
    if coding is None or Coding(coding) == Coding.AUTO:
        options = [Coding.FIXED, Coding.ZSTD, Coding.ZSTD_ALIGNED]
        options += [Coding.ELIAS, Coding.RANS, Coding.RANSX] if bits != 32 and numel < MAX_OMEGA else []
        body = max(max_body_bytes(numel, bits, c) for c in options)
    else:
        body = max_body_bytes(numel, bits, Coding(coding))
    return header_size(ndim, layout, nseg) + body + 4
