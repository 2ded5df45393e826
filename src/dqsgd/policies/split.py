"""One budget for both legs of the sharded step: the uplink width u and the downlink width v, chosen together.

With ``downlink_bits = "auto"`` (topology ``sharded``, a budgeted policy) the budget C counts what
one worker sends up (its W shard payloads at width u) and receives down (the W reduced shards at
width v), exactly as the ledger counts them, and every step picks the pair (u, v) that buys the
least convergence bound.

The bound of a pair. G = Q_v(Ĝ) with Ĝ = (1/W) Σ_w Q_u(g_w). Both roundings are unbiased with
independent uniforms, so their variances add (:func:`dqsgd.theory.two_stage_variance_bound`):
per coordinate at most ¼‖g‖∞²·(1/(W·s_u²) + 1/s_v²), s_b = 2^(b−1) − 1 levels, because ‖Ĝ‖∞ is
at most the largest worker norm. Theorems 1/3 charge step n w_n‖g_n‖² times that factor, so the
part a pair decides is

    Q(u, v) = 1/(W·s_u²) + 1/s_v²         (:func:`dqsgd.theory.two_stage_quantization_term`).

With the error-fed downlink (rounding to nearest, residual e kept), what the update misses at
step n is e_{n−1} − e_n, and ‖e_n‖² ≤ d·‖x_n‖∞²/(4·s_v²): the same form and constant as the
unbiased rounding's variance, entering the error-feedback bound at the same order η², so the
same Q(u, v) is used.

The continuous optimum. Cost d·(u + v) and u ≈ log2 s_u + 1: minimising Q at fixed u + v gives
W·s_u² = s_v², i.e. v = u + ½·log2 W — the downlink gets more bits, not fewer, since it is
rounded once where the uplink's W roundings average. The integers (and the headers, and the coded
uplink's far lower cost per bit) move it, so the policy does not use the rule: it enumerates the
pairs (at most 15 × 15).

Across steps. Q(u, v) = 1/(W·s_eq²) defines the pair's equivalent uplink levels s_eq, and along the
cheapest pairs cost grows linearly in log2 s_eq (twice as fast as one leg's), so DQSGD's
Lagrangian solution keeps its shape in s_eq: B_eq,n = log2(k·a_n·‖g_n‖ + 1) + 1. The budgeted
policy's online solve (forecast, bisection on k) runs unchanged in B_eq, with the cost of a real
B_eq interpolated between the Pareto pairs (least Q for their cost). The step's allowance is the
cost of the Pareto pair whose B_eq is nearest B_eq,n (as the one-leg policy rounds its width to
the nearest integer), capped by what keeps the remaining steps payable at the cheapest pair; the
pair is the least Q among all pairs whose cost fits the allowance (ties: cheaper, then the smaller
u). Two pairs can cost nearly the same (headers and byte rounding differ by a few bytes) and bound
very differently, which is why the allowance is a Pareto pair's cost and not the interpolated one. Nominal budget: every cost is exact, so C is never overspent. Coded budget: the uplink
is costed by its predicted coded size and capped by the same upper estimate as
:class:`~dqsgd.policies.coded.CodedBudgetedDQSGD`'s; a fixed downlink is exact.

A coded downlink (coding ``auto``, never larger than fixed: :mod:`dqsgd.topology.downlink`) is
charged its real bytes (``GradStats.down_bits``). Its cost at width v is estimated as the fixed
cost times ρ, the coded / fixed ratio of the last step's downlink (:attr:`SplitState.down_ratio`,
1 before the first), and capped by the fixed cost, which is its upper bound: the cap that keeps
the remaining steps payable uses the upper costs, so C is still never overspent.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dqsgd.policies.base import GradStats
from dqsgd.policies.budgeted import BudgetedDQSGD, forecast_norms
from dqsgd.policies.coded import CodedBudgetedDQSGD
from dqsgd.theory.formulas import bits_for_levels, two_stage_quantization_term


@dataclass(frozen=True)
class SplitState:
    bits: int                   # uplink width of the next step
    down_bits: int              # downlink width of the next step
    real_bits: float            # the planned equivalent width B_eq behind them
    spent: int                  # bits one worker has sent and received so far, both legs (measured)
    fit: tuple[float, ...]      # the norm forecast's decayed sums (BudgetedDQSGD)
    k: float                    # the last solved constant
    entropy: tuple[float, ...] = ()  # coded budget: H_B(G) per uplink width (CodedBudgetedDQSGD)
    ratio: float = 0.0               # coded budget: running real / predicted uplink body bits (nan: none yet)
    observed: float = 0.0            # coded budget: the last observed ratio (nan: none yet); nominal: 0, unused
    down_ratio: float = 1.0          # coded downlink: real / fixed bits of the last downlink (1: fixed, or none yet)


@dataclass(frozen=True)
class LegCosts:
    """The candidate pairs: uplink widths ``up`` (the policy's min..max), downlink widths ``down``,
    ``down_bits[i]``: the exact bits one worker receives at ``down[i]`` for ``workers`` shards (the
    fixed sizes: a coded downlink's upper bound, ``coded_down``)."""

    up: tuple[int, ...]
    down: tuple[int, ...]
    down_bits: tuple[int, ...]
    workers: int
    coded_down: bool = False

    @functools.cached_property
    def q(self) -> np.ndarray:
        """Q(u, v) for every pair, rows u, columns v (module docstring); read-only."""
        out = np.array([[two_stage_quantization_term([1.0], [u], [1.0], self.workers, v) for v in self.down]
                        for u in self.up], dtype=np.float64)
        out.setflags(write=False)
        return out

    def equivalent_bits(self, q: np.ndarray) -> np.ndarray:
        """B_eq of each pair: the uplink width whose W averaged roundings alone would give Q."""
        return np.asarray(bits_for_levels(1.0 / np.sqrt(self.workers * q), np.log2), dtype=np.float64)


def choose_pair(cost: np.ndarray, q: np.ndarray, allowance: float) -> tuple[int, int]:
    """(row, column) of the least Q among the pairs with ``cost`` ≤ ``allowance`` (ties: the cheaper,
    then the smaller row); the cheapest pair when none fits. ``cost``, ``q``: rows u, columns v."""
    fits = cost <= allowance
    if not fits.any():
        return np.unravel_index(int(np.argmin(cost)), cost.shape)  # type: ignore[return-value]
    keys = np.lexsort((np.indices(cost.shape)[0].ravel(), cost.ravel(), np.where(fits, q, np.inf).ravel()))
    return np.unravel_index(int(keys[0]), cost.shape)  # type: ignore[return-value]


def frontier(cost: np.ndarray, q: np.ndarray, beq: np.ndarray, tol: float) -> tuple[np.ndarray, np.ndarray]:
    """(B_eq, cost) of the Pareto pairs, cost increasing and B_eq strictly increasing: each pair the
    least Q for at most its cost (the planning's cost curve, interpolated between them). A pair
    cheaper than the next Pareto pair by at most ``tol`` bits is left out: headers and byte
    rounding make pairs of the same bits per coordinate, (5, 8) and (6, 7) say, differ by a few
    bytes, and the cheaper can bound far worse; the budget's feedback would otherwise settle on it."""
    order = np.lexsort((q.ravel(), cost.ravel()))
    xs, ys, best = [], [], math.inf
    for i in order:
        if q.ravel()[i] < best:
            best = q.ravel()[i]
            while ys and cost.ravel()[i] - ys[-1] <= tol:
                xs.pop()
                ys.pop()
            xs.append(beq.ravel()[i])
            ys.append(cost.ravel()[i])
    return np.asarray(xs), np.asarray(ys)


@dataclass(frozen=True)
class SplitBudget:
    """A budgeted policy (``inner``: :class:`BudgetedDQSGD` or :class:`CodedBudgetedDQSGD`, its budget
    both legs, its ``message_bits`` one worker's exact sharded uplink) choosing (u, v) per step."""

    inner: BudgetedDQSGD
    legs: LegCosts

    def __post_init__(self) -> None:
        cheapest = self.upper_up()[0] + min(self.legs.down_bits)
        if self.inner.budget_bits < self.inner.total_steps * cheapest:
            raise ValueError(f"infeasible budget: {self.inner.budget_bits} bits cannot pay {self.inner.total_steps} "
                             f"steps of both legs even at the cheapest pair ({cheapest:g} bits a step)")

    @property
    def budget_bits(self) -> int:
        """C: the bits one worker may send and receive over the run, both legs."""
        return self.inner.budget_bits

    @property
    def name(self) -> str:
        return f"{self.inner.name}+downlink"

    @property
    def needs_grad(self) -> bool:
        return self.inner.needs_grad

    @property
    def coded(self) -> bool:
        return isinstance(self.inner, CodedBudgetedDQSGD)

    def upper_up(self) -> np.ndarray:
        """Each uplink width's fixed size: exact for the nominal budget, an upper bound of the coded size
        (the coded budget's estimate before the first step)."""
        return np.array([self.inner.message_bits(u) for u in self.legs.up], dtype=np.float64)

    def costs(self, up: np.ndarray, down_ratio: float = 1.0) -> np.ndarray:
        """Both legs' bits of every pair, rows u, columns v; the downlink's fixed bits times ``down_ratio``."""
        return up[:, None] + down_ratio * np.asarray(self.legs.down_bits, dtype=np.float64)[None, :]

    def pick(self, allowance: float, cap: float, est: np.ndarray, upper: np.ndarray,
             down_ratio: float = 1.0) -> tuple[int, int]:
        """The pair of least Q whose estimated cost (the downlink at ``down_ratio`` of its fixed cost)
        fits ``allowance`` and upper cost fits ``cap``."""
        q = self.legs.q
        cost = np.where(self.costs(upper) <= cap, self.costs(est, down_ratio), np.inf)
        i, j = choose_pair(cost, q, allowance)
        if not math.isfinite(cost[i, j]):  # nothing fits the cap: the cheapest pair by its upper cost
            i, j = choose_pair(self.costs(upper), q, -math.inf)
        return self.legs.up[i], self.legs.down[j]

    def init(self) -> SplitState:
        n, up = self.inner.total_steps, self.upper_up()
        u, v = self.pick(self.inner.budget_bits / n, self.inner.budget_bits - (n - 1) * self.costs(up).min(), up, up)
        none = math.nan if self.coded else 0.0  # a nominal state compares equal to its copy (no nan)
        return SplitState(u, v, math.nan, 0, (0.0, 0.0, 0.0, 0.0, 0.0, math.inf, -math.inf), math.nan, (), none, none)

    def update(self, state: SplitState, stats: GradStats) -> SplitState:
        p = self.inner
        step, spent, fit = p.observe(state, stats)  # type: ignore[arg-type]
        fixed_down = self.legs.down_bits[self.legs.down.index(state.down_bits)]
        down_now = fixed_down if stats.down_bits is None else int(stats.down_bits)
        rho = min(1.0, down_now / fixed_down) if self.legs.coded_down and stats.down_bits is not None \
            else state.down_ratio
        learned: dict[str, Any] = {}
        if self.coded:  # the coded uplink's entropy and ratio learn from the uplink's share of the spend
            c: Any = p
            up_stats = replace(stats, spent_bits=int(stats.spent_bits) - down_now)
            learned = dict(zip(("entropy", "ratio", "observed"), c.learn(state, up_stats)))
        if step >= p.total_steps:
            return replace(state, spent=spent, fit=fit, down_ratio=rho, **learned)
        est = upper = self.upper_up()
        if self.coded:  # floored above the width just sent, as the coded policy's own estimates
            est, upper = c.estimates(*learned.values(), state.bits, up_stats.spent_bits)
        q = self.legs.q
        xs, ys = frontier(self.costs(est, rho), q, self.legs.equivalent_bits(q), p.numel / 16)
        forecast = forecast_norms(fit, stats.step, step + 1, p.total_steps, stats.norm, p.tau)
        left = float(p.budget_bits - spent)
        k, real = p.solve_widths(step, stats.norm, forecast, lambda w: float(np.interp(w, xs, ys).sum()), left)
        cap = left - (p.total_steps - step - 1) * self.costs(upper).min()
        nearest = int(np.argmin(np.abs(xs - real)))  # the Pareto pair nearest the planned B_eq (first of a tie)
        u, v = self.pick(min(float(ys[nearest]), cap), cap, est, upper, rho)
        return SplitState(u, v, real, spent, fit, k, down_ratio=rho, **learned)


def split_budget(inner: Any, budget_bits: int, uplink_bits: Any, down: tuple[int, ...], down_bits: tuple[int, ...],
                 workers: int, coded_down: bool = False) -> SplitBudget:
    """``inner`` (a budgeted policy) choosing both legs: its budget ``budget_bits`` (both legs), its
    cost of an uplink width ``uplink_bits(u)`` (one worker's W shard payloads, exact fixed size);
    ``coded_down``: the downlink is coded (``auto``), ``down_bits`` its fixed sizes."""
    if not isinstance(inner, BudgetedDQSGD):
        raise ValueError(f"downlink_bits = 'auto' splits a budget between the legs: it needs a budgeted policy "
                         f"(dqsgd-budget or dqsgd-coded), not {getattr(inner, 'name', inner)!r}; give an integer width")
    planner = replace(inner, budget_bits=int(budget_bits), message_bits=uplink_bits)
    return SplitBudget(planner, LegCosts(tuple(range(inner.min_bits, inner.max_bits + 1)), down, down_bits, workers,
                                         coded_down))
