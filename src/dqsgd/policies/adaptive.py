"""The adaptive baselines of DQSGD Table 1, both [OC] rules built from the papers' descriptions.

Adaptive (Oland & Raj, ICASSP 2015) — more bits for gradients with larger RMS [text, DQSGD §1]:
    B_n = clip(1 + ⌈log2(1 + RMS(G_n)/ε_A)⌉, B_min, B_max),
    ε_A = mean RMS of the first ``calib_steps`` steps / (2^(B_0−1) − 1)  [OC, docs/algorithms.md §6],
so training starts near B_0 bits and the width falls as the RMS falls.

AdaQS (Guo et al., ICASSP 2020) — bits from the mean-to-std ratio (MSDR), rising over time
[text, abstract]; the formula is [OC, docs/algorithms.md §7]: Adam-style moments m, v of G with
bias correction, σ̂_i = √max(v̂_i − m̂_i², 1e-12), MSDR = mean|m̂| / mean σ̂,
    B_t = clip(B_0 + ⌊log2(MSDR_ref / MSDR_t)⌋₊, B_min, B_max), kept non-decreasing,
with MSDR_ref the mean MSDR of the first ``ref_steps`` steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from dqsgd.policies.base import GradStats
from dqsgd.quantizers.uniform import levels_for_bits


def check_width_range(name: str, b0: int, lo: int, hi: int, start: str = "initial_bits") -> None:
    """A policy's widths: 2 <= min_bits <= its start width (named ``start``) <= max_bits <= 16."""
    if not 2 <= lo <= b0 <= hi <= 16:
        raise ValueError(f"{name}: need 2 <= min_bits <= {start} <= max_bits <= 16, got {lo}, {b0}, {hi}")


@dataclass(frozen=True)
class AdaptiveState:
    bits: int
    eps: float          # ε_A, nan until calibrated
    rms_sum: float
    count: int


@dataclass(frozen=True)
class AdaptiveRMS:
    initial_bits: int = 8
    min_bits: int = 2
    max_bits: int = 8
    calib_steps: int = 10
    name: str = "adaptive"
    needs_grad: bool = False

    def __post_init__(self) -> None:
        check_width_range("adaptive", self.initial_bits, self.min_bits, self.max_bits)
        if self.calib_steps < 1:
            raise ValueError("adaptive: calib_steps must be >= 1")

    def init(self) -> AdaptiveState:
        return AdaptiveState(self.initial_bits, float("nan"), 0.0, 0)

    def update(self, state: AdaptiveState, stats: GradStats) -> AdaptiveState:
        if state.count < self.calib_steps:
            rms_sum, count = state.rms_sum + stats.rms, state.count + 1
            eps = state.eps
            if count == self.calib_steps:
                eps = (rms_sum / count) / levels_for_bits(self.initial_bits)
            return AdaptiveState(state.bits, eps, rms_sum, count)
        if not state.eps > 0:  # all calibration gradients were zero: keep the initial width
            return state
        real = 1 + math.ceil(math.log2(1 + stats.rms / state.eps))
        return replace(state, bits=max(self.min_bits, min(self.max_bits, real)))


@dataclass(frozen=True)
class AdaQSState:
    bits: int
    m: torch.Tensor
    v: torch.Tensor
    t: int
    msdr_ref_sum: float
    msdr: float


@dataclass(frozen=True)
class AdaQS:
    numel: int
    initial_bits: int = 4
    min_bits: int = 2
    max_bits: int = 8
    ref_steps: int = 100
    beta1: float = 0.9
    beta2: float = 0.999
    name: str = "adaqs"
    needs_grad: bool = True

    def __post_init__(self) -> None:
        check_width_range("adaqs", self.initial_bits, self.min_bits, self.max_bits)
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1) or self.ref_steps < 1:
            raise ValueError("adaqs: need 0 <= beta1, beta2 < 1 and ref_steps >= 1")

    def init(self) -> AdaQSState:
        z = torch.zeros(self.numel, dtype=torch.float32)
        return AdaQSState(self.initial_bits, z, z.clone(), 0, 0.0, float("nan"))

    def update(self, state: AdaQSState, stats: GradStats) -> AdaQSState:
        if stats.grad is None:
            raise ValueError("adaqs needs the aggregated gradient (GradStats.grad)")
        g = stats.grad.reshape(-1).to(torch.float32)
        t = state.t + 1
        m = state.m.mul(self.beta1).add_(g, alpha=1 - self.beta1)
        v = state.v.mul(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        mh, vh = m / (1 - self.beta1**t), v / (1 - self.beta2**t)
        sigma = (vh - mh * mh).clamp_(min=1e-12).sqrt_()
        msdr = float(mh.abs().mean() / sigma.mean()) if g.numel() else 0.0
        if t <= self.ref_steps:
            return AdaQSState(state.bits, m, v, t, state.msdr_ref_sum + msdr, msdr)
        ref = state.msdr_ref_sum / self.ref_steps
        extra = max(0, math.floor(math.log2(ref / msdr))) if msdr > 0 and ref > 0 else 0
        bits = max(state.bits, max(self.min_bits, min(self.max_bits, self.initial_bits + extra)))
        return AdaQSState(bits, m, v, t, state.msdr_ref_sum, msdr)
