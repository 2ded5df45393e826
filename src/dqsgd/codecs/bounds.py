"""What a body of L bytes can carry: checked before a decoder allocates for the header's numel.

Each bound follows from the coding's format alone, so a forged element count is refused with no
allocation of its size; valid payloads never reach one (tested against the most compressible
inputs there are).
"""

from __future__ import annotations

from dqsgd.codecs.header import Coding, Header, PayloadError
from dqsgd.codecs.rans import M, RANS_L

__all__ = ["check_body_can_hold", "rans_numel_bound", "zstd_content_bound"]

_ZSTD_BLOCK_MAX = 1 << 17  # RFC 8878 §3.1.1.2: a block decompresses to at most 128 KiB
# After K = 1 and the symbol's varint, a one-symbol RANS body is its frequency M (varint) and the
# final state, which never moves from L: so the whole body is known from the symbol.
_ONE_SYMBOL_TAIL = bytes([0x80, 0x80, M >> 14]) + RANS_L.to_bytes(4, "little")


def zstd_content_bound(frame_len: int) -> int:
    """The most bytes a zstd frame of ``frame_len`` bytes can decompress to.

    A frame is the 4-byte magic, a frame header of ≥ 2 bytes, then blocks; every block has a
    3-byte header and yields at most 128 KiB (an RLE block does that from 1 more byte). So
    ``content ≤ 2^17 · ⌊(frame_len − 6) / 3⌋`` (about 44,000 : 1).
    """
    return _ZSTD_BLOCK_MAX * max(frame_len - 6, 0) // 3


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


def _is_one_symbol_body(body: memoryview) -> bool:
    """``01 | varint symbol (1-3 bytes) | 80 80 04 | L``: the only one-symbol RANS bodies there are."""
    g = len(body) - 1 - len(_ONE_SYMBOL_TAIL)
    return (1 <= g <= 3 and all(b & 0x80 for b in body[1:g]) and body[g] < 0x80
            and bytes(body[1 + g :]) == _ONE_SYMBOL_TAIL)


def check_body_can_hold(body: memoryview, h: Header, offset: int) -> None:
    """Refuse, before anything of ``numel`` is allocated, a body too short for the declared numel.

    FIXED's length is exact (checked by ``wire._unpack_fixed``); ZSTD is bounded by
    :func:`zstd_content_bound` (in ``wire.unzstd``); RANS by :func:`rans_numel_bound`, and a
    one-symbol RANS body (first byte 0x01: a constant tensor, no bits per code) must be exactly
    its table and the state L. ELIAS codes trailing zeros in no bits at all, so an Elias body of a
    few bytes can be a valid payload of any numel: only ``max_numel`` / ``numel`` bound those, and
    constant RANS tensors.
    """
    if h.coding != Coding.RANS or not h.numel:
        return
    if bytes(body[:1]) == b"\x01":
        if not _is_one_symbol_body(body):
            raise PayloadError(f"RANS body at offset {offset}: a one-symbol table must be followed by frequency "
                               f"{M} and the state {RANS_L}, and nothing else")
    elif h.numel > rans_numel_bound(len(body)):
        raise PayloadError(f"RANS body at offset {offset}: {len(body)} bytes with two or more symbols carry "
                           f"fewer than {rans_numel_bound(len(body))} codes, the header declares {h.numel}")
