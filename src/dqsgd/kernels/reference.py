"""The hash-RNG stochastic uniform quantizer in torch ops (any device): the fused kernels' reference.

For B ≥ 2 it is :func:`dqsgd.quantizers.quantize_uniform` with ``rng=HashRNG(...)``; for B = 1 it
is the stochastic binary quantizer (codes ±1, levels 1, scale r = ‖v‖_p, P(c_i = +1) =
(1 + v_i/r)/2, so E[r·c_i] = v_i), with the arithmetic of the fused kernel step for step.
"""

from __future__ import annotations

import torch

from dqsgd.kernels.hashrng import HashRNG
from dqsgd.quantizers import Layout, Norm, Quantized, Scheme, quantize_uniform
from dqsgd.quantizers.segments import check_bits, expand, flat_float, require_finite, segment_reduce

__all__ = ["quantize_uniform_hash"]


def quantize_uniform_hash(x: torch.Tensor, bits: int, rng: HashRNG, *, norm: Norm = Norm.MAX,
                          layout: Layout = Layout()) -> Quantized:
    """Codes and scales of the hash-RNG quantizer at ``bits`` ∈ 1..16, computed on ``x.device``."""
    check_bits(bits, 1, 16, "hash-RNG uniform quantizer")
    if bits >= 2:
        return quantize_uniform(x, bits, norm=norm, layout=layout, rng=rng)
    if norm not in (Norm.MAX, Norm.L2):
        raise ValueError(f"hash-RNG uniform quantizer: norm must be Norm.MAX or Norm.L2, got {norm!r}")
    flat = flat_float(x)
    n = flat.numel()
    scales = segment_reduce(flat, layout, "max_abs" if norm == Norm.MAX else "l2")
    require_finite(scales, "hash-RNG uniform quantizer")
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int32)
        return Quantized(Scheme.UNIFORM, 1, 1, empty, scales.cpu(), layout, tuple(x.shape), norm, dtype=x.dtype)
    inv = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    t = (flat * expand(inv, layout, n)).clamp_(-1.0, 1.0)
    up = rng.uniform(n, flat.device) < (t + 1.0) * 0.5
    codes = torch.where(up, 1, -1).to(torch.int32)
    return Quantized(Scheme.UNIFORM, 1, 1, codes.cpu(), scales.cpu(), layout, tuple(x.shape), norm, dtype=x.dtype)
