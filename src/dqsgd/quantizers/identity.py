"""Identity "quantizer": raw float32 (the Vanilla SGD row of DQSGD Table 1)."""

from __future__ import annotations

import torch

from dqsgd.quantizers.segments import flat_float, require_finite
from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme, SchemeQuantizer


def quantize_identity(x: torch.Tensor) -> Quantized:
    flat = flat_float(x)
    if flat.numel():
        require_finite(flat.abs().amax().reshape(1), "identity")
    empty_i = torch.zeros(0, dtype=torch.int32)
    empty_f = torch.zeros(0, dtype=torch.float32)
    return Quantized(Scheme.IDENTITY, 32, 1, empty_i, empty_f, Layout(), tuple(x.shape),
                     values=flat.cpu().clone(), dtype=x.dtype)


class IdentityQuantizer(SchemeQuantizer):
    """The registry entry of raw float32: 32 bits, no scales."""

    name, scheme, width = "identity", Scheme.IDENTITY, 32
    segment_scales = False

    def bits_error(self, bits: int) -> str | None:
        return None if bits == 32 else "the identity scheme sends fp32: bits must be 32"

    def quantize(self, x, bits, generator=None, *, layout=Layout(), norm=Norm.MAX, scaled=False, scalers=None,
                 clip=None) -> Quantized:
        return quantize_identity(x)


IDENTITY = IdentityQuantizer()
