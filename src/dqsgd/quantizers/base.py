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

**The finite-output rule** (:func:`dtype_limit`, :func:`step_bound`, :func:`overflow`, :func:`beyond`).
One rule for every decoder: a payload whose values would not be finite in the
output's dtype is refused before anything of it is added to the output.

A decoder adds ``v_i = w·(c_i·step_k)`` in float32 (``step_k = scale_k / levels``, as
:func:`dqsgd.quantizers.dequantize` computes it; raw schemes: ``v_i = w·x_i``), where ``w`` is the
caller's weight (1 for a plain decode). The rule: every ``v_i`` must be finite and at most the output
dtype's largest value (:func:`dtype_limit`: float32's for an accumulator, 65504 for a float16 result),
else the payload is refused (``PayloadError`` in the codecs and kernels, ``ValueError`` from
``dequantize``) and the output is as it was. Finite scales are not enough: a forged scale of 1e5 in a
float16 payload, or one near float32's top times the top code, is finite and decodes to ±inf.

Every decoder checks it with the functions here, in one of two forms, by where the values land:

* **added in place** into a float32 output (``decode_accumulate``, ``FixedPlan.accumulate``,
  ``decode_accumulate_device`` with its torch ops and Triton kernels, ``decode_into`` on a float32
  tensor): from the scales alone, before the body is read. :func:`step_bound` is the largest
  ``|v|`` a segment's scale can give at the scheme's top code, computed with the decoders' own
  float32 operations (rounding is monotone, so no decoded value exceeds it); it must be finite. For a
  max-norm payload it is exactly the largest decoded value (the segment's largest entry has the top
  code); an l2 scale within a few float32 ulps of float32's max whose codes stay below the top is
  refused too. Raw values (IDENTITY, SKETCH) are read from the body: their largest magnitude, NaN
  included (the host decoder's two passes over the body, nothing allocated).
* **narrowed** to float16/bfloat16 from a fresh float32 buffer (``decode``, ``decode_device``,
  ``decode_into`` on such a tensor, ``dequantize``): the values themselves (:func:`overflow` of their
  largest magnitude) once they are in the buffer, before it is narrowed, returned or added. Exact: a
  float16 l2 payload whose scale exceeds 65504 while every value fits is decoded.

On a device nothing is read to the host per payload for the in-place form, and nothing is launched
for it on the Triton path: the decode kernel's check pass computes the same bound from each
coordinate's step and sets its own flag (a segment with no coordinate decodes nothing and is not
looked at, on any path). The torch-ops decoder turns the bound into a device flag with :func:`beyond`
where the steps already are. Either flag is read with the other checks' flags in the one sync
``check="sync"`` makes anyway, or ORed into the caller's ``bad`` flag by ``check="defer"``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch


class Scheme(enum.IntEnum):
    """Quantization scheme id, as written in the wire header (one byte)."""

    IDENTITY = 0
    UNIFORM = 1
    SIGN = 2
    TERNARY = 3
    LOWPREC = 4
    SKETCH = 5  # a count sketch's r × c table of float32 sums (dqsgd.quantizers.sketch)


RAW_SCHEMES = frozenset({Scheme.IDENTITY, Scheme.SKETCH})


A = TypeVar("A", np.ndarray, torch.Tensor)


def dtype_limit(dtype: torch.dtype) -> float:
    """The largest magnitude a decoded value may have: it must fit float32 (the arithmetic) and the
    output's dtype (float16: 65504; bfloat16: 3.39e38), else it would round to ±inf."""
    return min(torch.finfo(torch.float32).max, torch.finfo(dtype).max)


def narrows(dtype: torch.dtype) -> bool:
    """Whether a float32 value may not fit ``dtype`` (float16, bfloat16): the narrowed form applies."""
    return dtype_limit(dtype) < torch.finfo(torch.float32).max


def step_bound(steps: A, top: int, weight: float) -> A:
    """Per segment, ``|w·(top·step)|`` in float32: the largest magnitude a decoder's float32
    ``w·(c·step)`` reaches for codes |c| ≤ ``top`` (float32 ``steps``: a numpy array on the host,
    a tensor where the decoder's steps are)."""
    if isinstance(steps, torch.Tensor):
        w = torch.full((), weight, dtype=torch.float32, device=steps.device)
        return (w * (torch.full((), float(top), dtype=torch.float32, device=steps.device) * steps)).abs()
    with np.errstate(over="ignore", invalid="ignore"):
        return np.abs(np.float32(weight) * (np.float32(top) * steps.astype(np.float32, copy=False)))


def overflow(peak: float, dtype: torch.dtype, what: str) -> str | None:
    """Why values of largest magnitude ``peak`` (NaN: some value is NaN) break the rule for a
    ``dtype`` output, or None when they fit; ``what`` names the payload."""
    if peak <= dtype_limit(dtype):
        return None
    name = str(dtype).removeprefix("torch.")
    return (f"{what} decodes to values beyond {name} or not finite (|w·x| up to {peak:.3e}: a forged scale?); "
            f"refused before anything was added")


def beyond(peak: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`overflow` as a 0-dim bool flag on ``peak``'s device (no sync): True where the largest
    of ``peak`` (NaN included) breaks the rule for a ``dtype`` output."""
    top = peak.amax() if peak.numel() else torch.zeros((), dtype=peak.dtype, device=peak.device)
    return ~(top <= dtype_limit(dtype))
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
