"""TernGrad (Wen et al. 2017): stochastic ternary quantization with a per-tensor scaler.

Per segment (parameter tensor) l [code, wenwei202/terngrad bingrad_common.py]:
  * candidate scaler s_l = c·σ(g_l) for clip factor c > 0 (population std), or max|g_l| for c = 0;
  * scaler sharing: s_l = max over workers (the caller passes the shared scalers);
  * t_k = sgn(g_k)·s_l if u_k·s_l < |g_k| (u_k ~ U[0,1)), else 0.
Inside [-s_l, s_l] E[t_k] = g_k (unbiased); larger entries are clipped to ±s_l.
Codes are {-1, 0, +1} at 2 bits per coordinate.
"""

from __future__ import annotations

import torch

from dqsgd.quantizers.segments import expand, flat_float, require_finite, segment_reduce
from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme, SchemeQuantizer
from dqsgd.quantizers.constants import TERNGRAD_CLIP

DEFAULT_CLIP = TERNGRAD_CLIP  # this module's name for it, kept for importers


def ternary_scalers(x: torch.Tensor, *, layout: Layout = Layout(), clip: float = DEFAULT_CLIP) -> torch.Tensor:
    """This worker's candidate scalers, one per segment (max-reduce them across workers)."""
    if clip < 0:
        raise ValueError(f"TernGrad clip factor must be >= 0 (0 = no clipping), got {clip}")
    flat = flat_float(x)
    maxabs = segment_reduce(flat, layout, "max_abs")
    require_finite(maxabs, "TernGrad")
    if clip == 0:
        return maxabs
    # c·σ can exceed max|g| on tiny segments; min() keeps the scaler no larger than needed.
    return torch.minimum(clip * segment_reduce(flat, layout, "std"), maxabs)


def quantize_ternary(
    x: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    layout: Layout = Layout(),
    scalers: torch.Tensor | None = None,
    clip: float = DEFAULT_CLIP,
) -> Quantized:
    flat = flat_float(x)
    n = flat.numel()
    if scalers is None:
        scalers = ternary_scalers(x, layout=layout, clip=clip)
    scalers = scalers.to(torch.float32).reshape(-1)
    if scalers.numel() != layout.num_segments(n):
        raise ValueError(f"TernGrad: {scalers.numel()} scalers for {layout.num_segments(n)} segments")
    require_finite(scalers, "TernGrad")
    require_finite(segment_reduce(flat, layout, "max_abs"), "TernGrad")
    u = torch.rand(n, generator=generator, device=flat.device, dtype=torch.float32)
    keep = (u * expand(scalers.to(flat.device), layout, n)) < flat.abs()
    codes = (torch.sign(flat) * keep).to(torch.int32)
    return Quantized(Scheme.TERNARY, 2, 1, codes.cpu(), scalers.cpu(), layout, tuple(x.shape), Norm.NONE, dtype=x.dtype)


class TernaryQuantizer(SchemeQuantizer):
    """The registry entry of TernGrad: 2 bits per coordinate, per-segment scalers shared (max-reduced)
    across workers before quantizing."""

    name, scheme, width = "ternary", Scheme.TERNARY, 2
    shares_scalers = True

    def scalers(self, x, *, layout=Layout(), clip=TERNGRAD_CLIP) -> torch.Tensor:
        return ternary_scalers(x, layout=layout, clip=clip)

    def quantize(self, x, bits, generator=None, *, layout=Layout(), norm=Norm.MAX, scaled=False, scalers=None,
                 clip=None) -> Quantized:
        return quantize_ternary(x, generator, layout=layout, scalers=scalers,
                                clip=TERNGRAD_CLIP if clip is None else clip)


TERNARY = TernaryQuantizer()
