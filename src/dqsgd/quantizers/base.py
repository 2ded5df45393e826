"""The common representation of a quantized tensor.

Every quantizer in dqsgd maps a float tensor to *signed integer codes* plus one float32
*scale* per segment, and back:  ``x̂_i = codes_i · scales[seg(i)] / levels``.

That one shape serves every scheme:

============  =======================  =================  ==================================
scheme        codes                    scale              levels
============  =======================  =================  ==================================
UNIFORM       ``sgn(g_i)·q_i ∈ [-s, s]``  ``‖v‖_p`` per bucket  ``s = 2^(B-1) - 1``
SIGN          ``±1``                    l1-mean or 1      1
TERNARY       ``{-1, 0, +1}``            max-norm / c·σ    1
LOWPREC       ``k_i ∈ [-2^(b-1), 2^(b-1)-1]``  δ              1
IDENTITY      (raw float32 in ``values``)  —               —
SKETCH        (raw float32 count-sketch table r × c in ``values``)  —  —
============  =======================  =================  ==================================

The codec (``dqsgd.codecs``) only moves this structure to bytes and back; it never needs to
know what the scales mean.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from dqsgd.quantizers.finite import overflow


class Scheme(enum.IntEnum):
    """Quantization scheme id, as written in the wire header (one byte)."""

    IDENTITY = 0
    UNIFORM = 1
    SIGN = 2
    TERNARY = 3
    LOWPREC = 4
    SKETCH = 5  # a count sketch's r × c table of float32 sums (dqsgd.quantizers.sketch)


RAW_SCHEMES = frozenset({Scheme.IDENTITY, Scheme.SKETCH})
"""Schemes whose messages carry raw float32 ``values`` (32 bits, no integer codes, no scales)."""


class Norm(enum.IntEnum):
    """Which norm the scale is (informational, one byte in the header)."""

    NONE = 0
    L1_MEAN = 1
    L2 = 2
    MAX = 255  # ‖·‖_∞


@dataclass(frozen=True)
class Layout:
    """How the flat tensor is cut into segments that each get one scale.

    ``bucket == 0 and sizes is None``: one segment (the whole tensor).
    ``bucket > 0``: consecutive buckets of ``bucket`` coordinates (the last may be shorter).
    ``sizes``: explicit segment lengths (e.g. one per parameter tensor); they sum to numel.
    """

    bucket: int = 0
    sizes: tuple[int, ...] | None = None

    def segment_sizes(self, numel: int) -> list[int]:
        if self.sizes is not None:
            if sum(self.sizes) != numel:
                raise ValueError(f"layout sizes sum to {sum(self.sizes)}, tensor has {numel} elements")
            return list(self.sizes)
        if numel == 0:
            return []
        if self.bucket <= 0 or self.bucket >= numel:
            return [numel]
        full, rest = divmod(numel, self.bucket)
        return [self.bucket] * full + ([rest] if rest else [])

    def num_segments(self, numel: int) -> int:
        return len(self.segment_sizes(numel))


@dataclass(frozen=True)
class Quantized:
    """A quantized tensor: what a worker really has to send.

    Attributes:
      scheme: which quantizer produced it.
      bits: code width on the wire in bits (1..16 for integer schemes; 32 for IDENTITY).
      levels: the divisor of the codes (``s`` for UNIFORM, 1 otherwise).
      codes: int32, 1-D, ``numel`` signed integer codes (empty for IDENTITY).
      scales: float32, 1-D, one per segment of ``layout``.
      layout: the segmentation that ``scales`` refers to.
      shape: the original tensor's shape.
      norm: which norm the scales are (informational).
      values: float32, 1-D raw values (the raw schemes, IDENTITY and SKETCH, only; else None).
      dtype: the dtype of the tensor that was quantized; :func:`dequantize` returns it (the
        arithmetic is float32 either way) and the payload header records it.
    """

    scheme: Scheme
    bits: int
    levels: int
    codes: torch.Tensor
    scales: torch.Tensor
    layout: Layout
    shape: tuple[int, ...]
    norm: Norm = Norm.NONE
    values: torch.Tensor | None = None
    dtype: torch.dtype = torch.float32

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def dequantize(q: Quantized) -> torch.Tensor:
    """``x̂_i = codes_i · scales[seg(i)] / levels`` (raw values for IDENTITY), in q.shape and q.dtype
    (computed in float32, then rounded once to q.dtype)."""
    return _dequantize32(q).to(q.dtype)


def _dequantize32(q: Quantized) -> torch.Tensor:
    if q.scheme in RAW_SCHEMES:
        assert q.values is not None
        return q.values.reshape(q.shape)
    numel = q.numel
    if numel == 0:
        try:
            return torch.zeros(q.shape, dtype=torch.float32)
        except RuntimeError as e:  # forged dims such as (0, 2^32-1, 2^32-1, 2^32-1): torch's strides overflow
            raise ValueError(f"shape {tuple(q.shape)} cannot be represented ({e})") from None
    step = q.scales.to(torch.float32) / float(q.levels)
    sizes = q.layout.segment_sizes(numel)
    if len(sizes) == 1:
        out = q.codes.to(torch.float32) * step[0]
    else:
        out = q.codes.to(torch.float32) * torch.repeat_interleave(step, torch.tensor(sizes))
    if (why := overflow(float(out.abs().amax()), q.dtype, f"{q.scheme.name} payload")) is not None:
        raise ValueError(why)  # finite scales, but code × step overflows the dtype (a forged scale)
    return out.reshape(q.shape)


class SchemeQuantizer(ABC):
    """A registry entry (:class:`dqsgd.quantizers.registry.Quantizer`) with the common defaults: a
    scheme of fixed width ``width`` (``None``: the configured width) that sends one scale per
    segment, is usable in a method, shares no scalers and has no fused kernel. A scheme module
    subclasses it, sets what differs and defines :meth:`quantize`."""

    name: str
    scheme: Scheme
    width: int | None = None
    dynamic = False
    method = True
    shares_scalers = False
    fused = False
    segment_scales = True

    def nominal_bits(self, bits: int) -> int:
        return bits if self.width is None else self.width

    def bits_error(self, bits: int) -> str | None:
        return None

    def scalers(self, x: torch.Tensor, *, layout: Layout = Layout(), clip: float = 0.0) -> torch.Tensor:
        raise ValueError(f"the {self.name} scheme shares no scalers between workers")

    @abstractmethod
    def quantize(self, x: torch.Tensor, bits: int, generator: torch.Generator | None = None, *,
                 layout: Layout = Layout(), norm: Norm = Norm.MAX, scaled: bool = False,
                 scalers: torch.Tensor | None = None, clip: float | None = None) -> Quantized: ...

    def __repr__(self) -> str:
        return f"<quantizer {self.name!r}>"
