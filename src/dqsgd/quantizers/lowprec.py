"""Fixed-point low-precision representation LP(δ, b) (Double Quantization; HALP).

Grid dom(δ, b) = {-2^(b-1)δ, …, -δ, 0, δ, …, (2^(b-1)-1)δ}. Each coordinate is rounded
stochastically to one of its two neighbouring grid points (unbiased inside the range);
values outside are clamped to the end points [recalled: HALP / De Sa convention].
Per coordinate Var ≤ δ²/4, so E‖Q(x) - x‖² ≤ d·δ²/4.

With δ = ‖x‖_∞/(2^(b-1) - 1) (the default) nothing is clamped and Q is exactly unbiased
[docs/algorithms.md §1.2]. Codes are two's-complement integers k_i with x̂_i = k_i·δ.
"""

from __future__ import annotations

import torch

from dqsgd.quantizers.segments import check_bits, flat_float, require_finite, segment_reduce
from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme, SchemeQuantizer
from dqsgd.quantizers.constants import levels_for_bits

MIN_BITS, MAX_BITS = 2, 16


def default_delta(x: torch.Tensor, bits: int) -> float:
    """δ = ‖x‖_∞ / (2^(b-1) - 1): the smallest grid step that needs no clamping."""
    m = segment_reduce(flat_float(x), Layout(), "max_abs")
    require_finite(m, "low-precision quantizer")
    return float(m[0]) / levels_for_bits(bits) if m.numel() else 0.0


def quantize_lowprec(
    x: torch.Tensor, bits: int, generator: torch.Generator | None = None, *, delta: float | None = None
) -> Quantized:
    check_bits(bits, MIN_BITS, MAX_BITS, "low-precision quantizer")
    flat = flat_float(x)
    n = flat.numel()
    if delta is None:
        delta = default_delta(x, bits)
    else:
        require_finite(segment_reduce(flat, Layout(), "max_abs"), "low-precision quantizer")
    if not (delta >= 0 and delta < float("inf")):
        raise ValueError(f"low-precision quantizer: delta must be finite and >= 0, got {delta}")
    hi = levels_for_bits(bits)  # the grid's top, 2^(b-1) - 1; its bottom is -2^(b-1)
    lo = -hi - 1
    scales = torch.tensor([delta] if n else [], dtype=torch.float32)  # an empty tensor has no segment
    if n == 0 or delta == 0.0:
        codes = torch.zeros(n, dtype=torch.int32)
        return Quantized(Scheme.LOWPREC, bits, 1, codes, scales, Layout(), tuple(x.shape), Norm.MAX, dtype=x.dtype)
    a = (flat / delta).clamp_(lo, hi)
    low = a.floor()
    u = torch.rand(n, generator=generator, device=flat.device, dtype=torch.float32)
    k = (low + (u < (a - low)).to(torch.float32)).clamp_(lo, hi)
    return Quantized(Scheme.LOWPREC, bits, 1, k.to(torch.int32).cpu(), scales, Layout(), tuple(x.shape),
                     Norm.MAX, dtype=x.dtype)


class LowPrecQuantizer(SchemeQuantizer):
    """The registry entry of LP(δ, b) with the default δ: any width in [2, 16] per call, one segment.
    ``dqsgd.encode`` offers it; it is not a method scheme (Double Quantization uses it directly)."""

    name, scheme = "lowprec", Scheme.LOWPREC
    dynamic, method = True, False

    def quantize(self, x, bits, generator=None, *, layout=Layout(), norm=Norm.MAX, scaled=False, scalers=None,
                 clip=None) -> Quantized:
        return quantize_lowprec(x, bits, generator)


LOWPREC = LowPrecQuantizer()
