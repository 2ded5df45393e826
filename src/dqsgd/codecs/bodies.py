"""The FIXED body and the zstd frame of the wire format, below both the wire codec and AUTO's size search.

``fixed_body`` is FIXED's packing (offset binary, ``width`` bits per code); ZSTD and ZSTD_ALIGNED are one
zstd frame (level 3, content size in the frame header) of such a packing.
"""

from __future__ import annotations

import threading
from types import ModuleType

import numpy as np

from dqsgd.codecs.bitpack import pack_bits

__all__ = ["ZSTD_LEVEL", "fixed_body", "zstandard_module", "zstd_compress"]

ZSTD_LEVEL = 3


def zstandard_module() -> ModuleType:
    """zstandard, imported where a ZSTD coding is used (the FIXED codec runs without it)."""
    import zstandard

    return zstandard


_LOCAL = threading.local()  # one compressor per thread (a ZstdCompressor is not thread-safe)


def zstd_compress(body: np.ndarray | bytes) -> bytes:
    """One zstd frame (level 3, content size in the header) of ``body``: ZSTD and ZSTD_ALIGNED.

    The thread's compressor is reused (its context costs about as much to build as a 4 KiB frame,
    and AUTO compresses eight such samples); each call writes one whole frame, the same bytes as a
    fresh compressor's."""
    c = getattr(_LOCAL, "zstd", None)
    if c is None:
        c = _LOCAL.zstd = zstandard_module().ZstdCompressor(level=ZSTD_LEVEL)
    return c.compress(body)


def fixed_body(data: np.ndarray, bits: int, width: int) -> np.ndarray:
    """FIXED's packing of the codes (offset binary of ``bits``) at ``width`` ≥ bits."""
    if bits == 32:  # IDENTITY, SKETCH: raw little-endian float32
        return data.astype("<f4", copy=False).view(np.uint8)
    if bits == 1:
        return pack_bits(data > 0, width)
    return pack_bits(data, width, offset=1 << (bits - 1))
