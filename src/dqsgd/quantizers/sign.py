"""Sign quantization: SignSGD (Seide et al. 2014; Bernstein et al. 2019) and scaled sign.

Codes are ±1 at 1 bit per coordinate. Ties (g_i = 0) map to +1 so the message stays exactly one
bit per coordinate [OC, docs/algorithms.md §4]. The scale is 1 (plain sign) or the per-segment
l1-mean ‖v‖₁/d_v (scaled sign, the compressor of EF-SignSGD [recalled, Karimireddy et al. 2019]).
The sign quantizer is biased; it is deterministic (no generator).

Majority vote (signSGD-MV) is an aggregation, see :func:`majority_vote`.
"""

from __future__ import annotations

import torch

from dqsgd.quantizers.segments import flat_float, require_finite, segment_reduce
from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme, SchemeQuantizer


def quantize_sign(x: torch.Tensor, *, scaled: bool = False, layout: Layout = Layout()) -> Quantized:
    flat = flat_float(x)
    # The l1-mean is computed either way: it is the finiteness check for NaN/Inf input.
    l1 = segment_reduce(flat, layout, "l1_mean")
    require_finite(l1, "sign quantizer")
    scales = l1 if scaled else torch.ones_like(l1)
    codes = torch.where(flat < 0, -1, 1).to(torch.int32)
    norm = Norm.L1_MEAN if scaled else Norm.NONE
    return Quantized(Scheme.SIGN, 1, 1, codes.cpu(), scales.cpu(), layout, tuple(x.shape), norm, dtype=x.dtype)


def majority_vote(codes: list[torch.Tensor], voters: list[bool] | None = None) -> torch.Tensor:
    """The vote of signSGD-MV (the one vote of dqsgd, docs/algorithms.md §4): ``sign(Σ_{w voting} c_w)``
    as int32 codes, a tie → +1 (as a code of 0 is: one bit per coordinate on the downlink).

    ``voters[w]`` False: worker w abstains (the DDP hook: a rank whose whole bucket is zero, e.g.
    unused parameters); when nobody votes the result is 0, so a bucket that is zero everywhere stays
    zero. Every payload is still decoded (validated) by the caller; None: everyone votes."""
    if not codes:
        raise ValueError("majority_vote needs at least one worker's codes")
    if voters is not None and len(voters) != len(codes):
        raise ValueError(f"{len(voters)} voter flags for {len(codes)} workers")
    ballots = [c.to(torch.int32) for w, c in enumerate(codes) if voters is None or voters[w]]
    if not ballots:
        return torch.zeros_like(codes[0], dtype=torch.int32)
    total = torch.stack(ballots).sum(dim=0)
    return torch.where(total < 0, -1, 1).to(torch.int32)


class SignQuantizer(SchemeQuantizer):
    """The registry entries of the sign scheme, 1 bit per coordinate: ``sign`` (scaled with
    ``scaled=True``, as a method's ``scaled_sign`` asks) and ``scaled-sign`` (always scaled: the
    name ``dqsgd.encode`` takes)."""

    scheme, width = Scheme.SIGN, 1

    def __init__(self, name: str, scaled: bool, method: bool) -> None:
        self.name, self.scaled, self.method = name, scaled, method

    def quantize(self, x, bits, generator=None, *, layout=Layout(), norm=Norm.MAX, scaled=False, scalers=None,
                 clip=None) -> Quantized:
        return quantize_sign(x, scaled=self.scaled or scaled, layout=layout)


SIGN = SignQuantizer("sign", scaled=False, method=True)
SCALED_SIGN = SignQuantizer("scaled-sign", scaled=True, method=False)
