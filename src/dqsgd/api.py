"""The convenience API: ``encode(tensor, ...) -> bytes`` and ``decode(bytes) -> tensor``."""

from __future__ import annotations

import torch

from dqsgd.codecs import Coding, decode as decode_payload, encode as encode_payload
from dqsgd.quantizers import (
    Layout, Norm, dequantize, quantize_identity, quantize_lowprec, quantize_sign, quantize_ternary, quantize_uniform,
)

_NORMS = {"inf": Norm.MAX, "2": Norm.L2, 2: Norm.L2}


def encode(
    tensor: torch.Tensor,
    *,
    scheme: str = "uniform",
    bits: int = 4,
    norm: str | int = "inf",
    bucket: int = 0,
    coding: str = "fixed",
    generator: torch.Generator | None = None,
) -> bytes:
    """Quantize ``tensor`` with ``scheme`` (uniform | sign | scaled-sign | ternary | lowprec | identity)
    and return the self-describing payload that would cross the wire.

    ``coding``: "fixed" (bit-packed), "elias" (QSGD's Elias-omega code of the levels),
    "zstd" (zstd on the packed codes), "zstd-aligned" (zstd on codes padded to a byte-aligned width:
    closer to the entropy at 3, 5, 6, 7 bits), "rans" (static rANS of the levels: within ~0.1% of their
    empirical entropy plus a small frequency table; integer schemes only) or "auto" (the smallest of
    fixed, elias, zstd-aligned and rans).
    """
    cod = Coding.from_name(coding)
    if norm not in _NORMS:
        raise ValueError(f"unknown norm {norm!r}; use 'inf' or '2'")
    layout = Layout(bucket=bucket)
    if scheme == "uniform":
        q = quantize_uniform(tensor, bits, generator, norm=_NORMS[norm], layout=layout)
    elif scheme in ("sign", "scaled-sign"):
        q = quantize_sign(tensor, scaled=scheme == "scaled-sign", layout=layout)
    elif scheme == "ternary":
        q = quantize_ternary(tensor, generator, layout=layout)
    elif scheme == "lowprec":
        q = quantize_lowprec(tensor, bits, generator)
    elif scheme == "identity":
        q = quantize_identity(tensor)
    else:
        raise ValueError(f"unknown scheme {scheme!r}; use uniform, sign, scaled-sign, ternary, lowprec or identity")
    return encode_payload(q, cod)


def decode(payload: bytes | bytearray | memoryview, *, max_numel: int = 1 << 28) -> torch.Tensor:
    """The tensor a payload stands for. A truncated, corrupted or foreign payload raises ValueError."""
    return dequantize(decode_payload(payload, max_numel=max_numel))
