"""The FIXED body and the zstd frame of the wire format, below both the wire codec and AUTO's size search.

``fixed_body`` is FIXED's packing (offset binary, ``width`` bits per code); ZSTD and ZSTD_ALIGNED are one
zstd frame (level 3, content size in the frame header) of such a packing.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from dqsgd.codecs.bitpack import pack_bits

__all__ = ["ZSTD_LEVEL", "fixed_body", "zstandard_module", "zstd_compress"]

ZSTD_LEVEL = 3


def zstandard_module() -> ModuleType:
    """zstandard, imported where a ZSTD coding is used (the FIXED codec runs without it)."""
    import zstandard

    return zstandard


def zstd_compress(body: np.ndarray | bytes) -> bytes:
    """One zstd frame (level 3, content size in the header) of ``body``: ZSTD and ZSTD_ALIGNED."""
    return zstandard_module().ZstdCompressor(level=ZSTD_LEVEL).compress(body)


def fixed_body(data: np.ndarray, bits: int, width: int) -> np.ndarray:
    """FIXED's packing of the codes (offset binary of ``bits``) at ``width`` ≥ bits."""
    if bits == 32:  # IDENTITY, SKETCH: raw little-endian float32
        return data.astype("<f4", copy=False).view(np.uint8)
    if bits == 1:
        return pack_bits(data > 0, width)
    return pack_bits(data, width, offset=1 << (bits - 1))
