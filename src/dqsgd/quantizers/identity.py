"""Identity "quantizer": raw float32 (the Vanilla SGD row of DQSGD Table 1)."""

from __future__ import annotations

import torch

from dqsgd.quantizers._common import flat_float, require_finite
from dqsgd.quantizers.base import Layout, Quantized, Scheme


def quantize_identity(x: torch.Tensor) -> Quantized:
    flat = flat_float(x)
    if flat.numel():
        require_finite(flat.abs().amax().reshape(1), "identity")
    empty_i = torch.zeros(0, dtype=torch.int32)
    empty_f = torch.zeros(0, dtype=torch.float32)
    return Quantized(Scheme.IDENTITY, 32, 1, empty_i, empty_f, Layout(), tuple(x.shape),
                     values=flat.cpu().clone(), dtype=x.dtype)
