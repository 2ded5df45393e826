"""The byte budget of a sparse method: each round's value width b *and* density k (policy ``sparse-budget``).

A sparse message (:mod:`dqsgd.quantizers.sparse`) of k coordinates at value width b costs c(k, b) bits
on the wire — exactly, or (sharded: one message per shard, the kept coordinates' split among the shards
unknown in advance) an upper bound given by the step. With a budget of C bits per worker over N rounds:

1. the round's allowance is what is left spread evenly over the rounds left:
   A_r = ⌊(C − spent_r) / (N − r)⌋, spent_r = the bits a worker really sent in rounds 0..r−1
   (measured: the largest of the workers' uplinks);
2. for each width b in [min_bits, max_bits], k_b = the largest k ≤ d with c(k, b) ≤ A_r;
3. the round sends the (k_b, b) of least predicted error of the round's message, from the last
   averaged pseudo-gradient g (sorted magnitudes |g|_(1) ≥ |g|_(2) ≥ …, s_b = 2^(b−1) − 1; the
   stochastic uniform rounding of k values at scale m adds at most k·m²/(4 s_b²)):

   * top-k:    E_b = Σ_{i > k_b} |g|_(i)²  +  k_b·‖g‖∞² / (4 s_b²)          (dropped mass + rounding)
   * random-k: E_b = (d/k_b − 1)·‖g‖²      +  k_b·(d/k_b)²·‖g‖∞² / (4 s_b²)  (variance of the
     d/k-scaled subsample + rounding of values up to (d/k)‖g‖∞)

   ties to the smaller b. Before the first aggregate: b = the start width B_0 (``bits``), with its k.

The budget is never overspent: every round's cost is at most its allowance, and an allowance is at
least the previous one's share of what was left, so A_r ≥ C/N ≥ c(1, min_bits), which the policy
checks at its start (a budget below it is refused). The widths trade precision against coverage:
where g's mass is concentrated (few large coordinates) the rule spends the bytes on more bits per
value; where it is spread, on more coordinates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dqsgd.codecs.sketch_wire import IndexKind, index_message_size, index_width
from dqsgd.codecs.sparse_wire import sparse_message_size
from dqsgd.policies.adaptive import check_width_range
from dqsgd.policies.base import GradStats

__all__ = ["SparseBudget", "SparseBudgetState", "budget_policy", "message_cost"]


@dataclass(frozen=True)
class SparseBudgetState:
    bits: int        # value width of the next round
    count: int       # k: coordinates of the next round
    spent: int       # bits one worker has sent so far (measured)
    allowance: int   # A_r of the next round


@dataclass(frozen=True)
class SparseBudget:
    budget_bits: int
    total_steps: int
    numel: int
    cost: Callable[[int, int], int] = field(compare=False)  # c(k, b) in bits, non-decreasing in k
    kind: str = "topk"
    bits: int = 4
    min_bits: int = 2
    max_bits: int = 16
    name: str = "sparse-budget"
    needs_grad: bool = True

    def __post_init__(self) -> None:
        if self.total_steps < 1 or self.numel < 1:
            raise ValueError(f"sparse budget: need total_steps >= 1 and numel >= 1, got {self.total_steps}, {self.numel}")
        check_width_range("sparse budget", self.bits, self.min_bits, self.max_bits, start="bits")
        need = self.total_steps * self.cost(1, self.min_bits)
        if self.budget_bits < need:
            raise ValueError(f"infeasible budget: {self.budget_bits} bits cannot pay {self.total_steps} rounds of one "
                             f"coordinate at min_bits={self.min_bits} ({self.cost(1, self.min_bits)} bits each, "
                             f"{need} in all)")

    def count_for(self, allowance: int, bits: int) -> int:
        """k_b: the most coordinates (≤ d) whose message at width ``bits`` costs at most ``allowance`` (0: none)."""
        lo, hi = 0, self.numel  # c(lo) ≤ A holds for lo = 0 by convention; bisect the largest such k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost(mid, bits) <= allowance:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def init(self) -> SparseBudgetState:
        allowance = self.budget_bits // self.total_steps
        return self._start(allowance, 0)

    def _start(self, allowance: int, spent: int) -> SparseBudgetState:
        bits = self.bits if self.count_for(allowance, self.bits) else self.min_bits
        return SparseBudgetState(bits, self.count_for(allowance, bits), spent, allowance)

    def errors(self, allowance: int, grad: torch.Tensor) -> list[tuple[float, int, int]]:
        """(predicted error E_b, b, k_b) of every affordable width (module docstring, step 3)."""
        g = grad.detach().reshape(-1).to(torch.float64)
        d = g.numel()
        sq = torch.sort(g * g, descending=True).values
        tail = torch.cumsum(sq.flip(0), 0).flip(0)  # tail[i] = Σ_{j ≥ i} sq[j]
        total, top = float(tail[0]) if d else 0.0, float(sq[0]) if d else 0.0
        out = []
        for b in range(self.min_bits, self.max_bits + 1):
            k = self.count_for(allowance, b)
            if k < 1:
                continue
            rounding = k * top / (4.0 * ((1 << (b - 1)) - 1) ** 2)
            if self.kind == "topk":
                err = (float(tail[k]) if k < d else 0.0) + rounding
            else:
                err = (d / k - 1.0) * total + (d / k) ** 2 * rounding
            out.append((err, b, k))
        return out

    def update(self, state: SparseBudgetState, stats: GradStats) -> SparseBudgetState:
        spent = state.spent + int(stats.spent_bits)
        left = self.total_steps - stats.step - 1
        if left <= 0:
            return SparseBudgetState(state.bits, state.count, spent, 0)
        allowance = (self.budget_bits - spent) // left
        if stats.grad is None or not math.isfinite(stats.norm) or stats.norm == 0:
            return self._start(allowance, spent)
        best = min(self.errors(allowance, stats.grad), default=None)
        if best is None:  # only where a round spent more than its allowance (a cost that is not a bound)
            raise ValueError(f"sparse budget: {self.budget_bits - spent} bits left cannot pay one coordinate in each "
                             f"of the {left} rounds left (spent {spent} of {self.budget_bits})")
        return SparseBudgetState(best[1], best[2], spent, allowance)


def message_cost(d: int, shards: int) -> Callable[[int, int], int]:
    """c(k, b) in bits: one message of k of d coordinates at value width b (exact, :func:`sparse_message_size`),
    or (``shards`` > 1: one message per shard, k split among them in a way not known in advance) a bound on
    the W messages: per shard at most 18 bytes of index header, crc and padding, a values header in at most
    min(W, k) of them, and k·(⌈log2 d⌉ + b) bits of indices and values."""
    if shards == 1:
        return lambda k, b: 8 * sparse_message_size(d, k, b)
    values_head = sparse_message_size(d, 1, 2) - index_message_size(d, 1, IndexKind.INDICES) - 1
    return lambda k, b: 8 * (18 * shards + min(shards, k) * values_head) + k * (index_width(d) + b)


def budget_policy(config: Any, numel: int, rounds: int, shards: int = 1) -> SparseBudget:
    """The ``sparse-budget`` policy of a method (its :class:`~dqsgd.method.config.MethodConfig`) over ``numel`` coordinates and ``rounds`` exchanges, its messages
    cut in ``shards``; the budget ``budget_bits``, or ``target_bits`` per coordinate and round: ⌊N·d·target⌋."""
    budget = config.budget_bits or math.floor(rounds * numel * config.target_bits)
    return SparseBudget(budget, rounds, numel, message_cost(numel, shards), config.scheme, config.bits,
                        config.min_bits, config.max_bits)
