"""Closed-form bit rules: fixed B, DQSGD strongly convex (eq. 18) and non-convex (eq. 20).

* strongly convex [text, DQSGD eq. (18)]:  B_n = log2(k·α^((N−n)/2)·‖g_n‖_p + 1) + 1
* non-convex      [text, DQSGD eq. (20)]:  B_n = log2(t·‖g_n‖_p + 1) + 1
* error target    [OC, docs/algorithms.md §8]: the same two shapes with k or t derived from a target
  ε_Q on the quantization term of the bound (see :func:`dqsgd.theory.error_target_k`).

Following Algorithm 2, the width for step n+1 is computed from the aggregated gradient of step n
(‖G(x^(n))‖_p), so B_{n+1} can be broadcast with the update. The real width is turned into an
integer with :func:`integerize` and clipped to [min_bits, max_bits].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dqsgd.policies.base import GradStats, Rounding, integerize
from dqsgd.theory.formulas import bits_for_levels


@dataclass(frozen=True)
class RuleState:
    bits: int            # width for the next step
    real_bits: float     # the rule's real value behind it (nan before the first update)
    carry: float = 0.0   # error-diffusion residue (Rounding.CARRY)


@dataclass(frozen=True)
class FixedBits:
    """Always B bits (QSGD with a fixed width)."""

    bits: int
    name: str = "fixed"
    needs_grad: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 32:
            raise ValueError(f"fixed bits must be in [1, 32], got {self.bits}")

    def init(self) -> RuleState:
        return RuleState(self.bits, float(self.bits))

    def update(self, state: RuleState, stats: GradStats) -> RuleState:
        return state


@dataclass(frozen=True)
class DQSGDRule:
    """DQSGD's closed-form widths.

    ``convex=True`` uses eq. (18) with constants k, α and the horizon N; otherwise eq. (20) with
    t (= k). ``initial_bits`` is B_0 (Algorithm 2 needs a width before any gradient is seen).
    """

    k: float
    total_steps: int
    alpha: float = 1.0
    convex: bool = False
    initial_bits: int = 8
    min_bits: int = 2
    max_bits: int = 16
    rounding: Rounding = Rounding.NEAREST
    name: str = "dqsgd"
    needs_grad: bool = False

    def __post_init__(self) -> None:
        if not (self.k > 0 and math.isfinite(self.k)):
            raise ValueError(f"DQSGD: k (or t) must be > 0, got {self.k}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"DQSGD: alpha must be in (0, 1], got {self.alpha}")
        if self.total_steps < 1:
            raise ValueError(f"DQSGD: total_steps N must be >= 1, got {self.total_steps}")
        if not 2 <= self.min_bits <= self.max_bits <= 16:
            raise ValueError(f"DQSGD: need 2 <= min_bits <= max_bits <= 16, got [{self.min_bits}, {self.max_bits}]")
        if not self.min_bits <= self.initial_bits <= self.max_bits:
            raise ValueError(f"DQSGD: initial_bits {self.initial_bits} outside [{self.min_bits}, {self.max_bits}]")

    def real_width(self, step: int, norm: float) -> float:
        """B_step from ‖g‖: eq. (18) if convex, else eq. (20). Past the horizon (step > N) the convex
        rule keeps eq. (18)'s last factor α⁰ = 1, instead of widening as α^(−(step−N)/2)."""
        scale = self.k * (self.alpha ** (max(self.total_steps - step, 0) / 2) if self.convex else 1.0)
        return bits_for_levels(scale * norm)

    def init(self) -> RuleState:
        return RuleState(self.initial_bits, float("nan"))

    def update(self, state: RuleState, stats: GradStats) -> RuleState:
        real = self.real_width(stats.step + 1, stats.norm)
        bits, carry = integerize(real, self.rounding, state.carry, self.min_bits, self.max_bits)
        return replace(state, bits=bits, real_bits=real, carry=carry)
