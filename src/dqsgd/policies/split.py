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
charged its real bytes (``GradStats.down_bits``) and costed as the coded uplink is
(:mod:`dqsgd.policies.coded`): at width v, its headers plus r·d·H_v(G), H_v the expected entropy of
stochastic max-norm rounding of the update G at v (:func:`~dqsgd.policies.coded.level_entropies`, on
G's entropy sample at the sample's largest magnitude: what the DDP hook keeps of G), r a running ratio of the real body bits to the predicted ones at the width sent
(:attr:`SplitState.down_ratio`); above the width just sent, at least its measured body plus one
bit per coordinate per extra bit (G's levels do not resolve finer widths); never above the fixed
cost. The upper estimate takes 1.1 × the larger of r and the last observed ratio. Before the first
step every width is costed at its fixed size. As for the coded uplink, the "never overspent"
property then rests on that margin rather than on arithmetic (the fixed cost is the only hard
bound, and a budget below the cheapest fixed pair — ``downlink_target_bits`` of 1, say — relies on
coding); the budget must only pay the headers of both legs (``LegCosts.down_floor``).
``tests/topology/test_downlink_coding.py`` trains through the simulation at such budgets and checks
the ledger against C at every step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from dqsgd.policies.base import GradStats
from dqsgd.policies.budgeted import BudgetedDQSGD, forecast_norms
from dqsgd.policies.coded import CodedBudgetedDQSGD, level_entropies, sample_stride
from dqsgd.theory.formulas import bits_for_levels, two_stage_quantization_term


DOWN_MARGIN = 1.1     # a coded downlink's upper cost: this times the larger of its ratios (as the coded uplink's)
DOWN_SMOOTHING = 0.3  # the weight of the last observed ratio in the running one
SAMPLE = 1 << 16      # coordinates of G the entropies are computed on (a fixed stride)


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
    down_ratio: float = 0.0          # coded downlink: running real / predicted body bits (0: fixed, or none yet)
    down_observed: float = 0.0       # coded downlink: the last observed ratio (0: none yet)


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
    down_floor: float = 0.0  # the least a coded downlink can cost: its W payloads' headers, bits

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
        up = float(getattr(self.inner, "header_bits")) if self.coded else self.upper_up()[0]
        cheapest = up + (self.legs.down_floor if self.legs.coded_down else min(self.legs.down_bits))
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
        return self.inner.needs_grad or self.legs.coded_down

    @property
    def coded(self) -> bool:
        return isinstance(self.inner, CodedBudgetedDQSGD)

    def upper_up(self) -> np.ndarray:
        """Each uplink width's fixed size: exact for the nominal budget, an upper bound of the coded size
        (the coded budget's estimate before the first step)."""
        return np.array([self.inner.step_bits(u) for u in self.legs.up], dtype=np.float64)

    def costs(self, up: np.ndarray, down: np.ndarray | None = None) -> np.ndarray:
        """Both legs' bits of every pair, rows u, columns v; ``down``: the downlink's cost per width
        (default its fixed bits)."""
        down = np.asarray(self.legs.down_bits if down is None else down, dtype=np.float64)
        return up[:, None] + down[None, :]

    def pick(self, allowance: float, cap: float, est: np.ndarray, upper: np.ndarray,
             down: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[int, int]:
        """The pair of least Q whose estimated cost fits ``allowance`` and upper cost fits ``cap``
        (``down``: the downlink's estimated and upper cost per width; default its fixed bits)."""
        q = self.legs.q
        d_est, d_up = (None, None) if down is None else down
        cost = np.where(self.costs(upper, d_up) <= cap, self.costs(est, d_est), np.inf)
        i, j = choose_pair(cost, q, allowance)
        if not math.isfinite(cost[i, j]):  # nothing fits the cap: the cheapest pair by its upper cost
            i, j = choose_pair(self.costs(upper, d_up), q, -math.inf)
        return self.legs.up[i], self.legs.down[j]

    def down_costs(self, entropy: np.ndarray, width: int, body: float, ratio: float,
                   observed: float) -> tuple[np.ndarray, np.ndarray]:
        """(estimated, upper) bits of a coded downlink at each width after one at ``width`` whose payloads'
        bodies took ``body`` bits (module docstring); ``entropy``: H_v(G) at each downlink width."""
        legs, d = self.legs, float(self.inner.numel)
        fixed = np.asarray(legs.down_bits, dtype=np.float64)
        widths = np.asarray(legs.down, dtype=np.float64)

        def cost(r: float, margin: float) -> np.ndarray:
            above = np.where(widths > width, legs.down_floor + margin * (body + d * (widths - width)), 0.0)
            return np.maximum.accumulate(np.minimum(fixed, np.maximum(legs.down_floor + r * d * entropy, above)))

        return cost(ratio, 1.0), cost(DOWN_MARGIN * max(ratio, observed), DOWN_MARGIN)

    def down_entropies(self, grad: torch.Tensor) -> np.ndarray:
        """H_v(G) at every downlink width, from G's entropy sample (:func:`~dqsgd.policies.coded.sample_stride`)
        at the sample's largest magnitude: the same numbers from G as from the sample alone, which is what
        the DDP hook keeps of G for a coded policy (``read_stride``)."""
        g = grad.detach().reshape(-1)
        g = g[:: sample_stride(g.numel(), int(getattr(self.inner, "sample", SAMPLE)))]
        norm = float(g.abs().max()) if g.numel() else 0.0
        widths = range(self.legs.down[0], self.legs.down[-1] + 1)  # contiguous (bucket.py builds it so)
        return np.asarray(level_entropies(g, norm, widths, g.numel()), dtype=np.float64)[
            [v - widths.start for v in self.legs.down]]

    def learn_down(self, state: SplitState, stats: GradStats,
                   down_now: int) -> tuple[float, float, tuple[np.ndarray, np.ndarray] | None]:
        """(running ratio, observed ratio, the downlink's (estimated, upper) costs or None: fixed) after a
        step whose downlink at ``state.down_bits`` cost ``down_now`` bits."""
        if not self.legs.coded_down or stats.down_bits is None or stats.grad is None:
            return state.down_ratio, state.down_observed, None
        body = max(0.0, down_now - self.legs.down_floor)
        entropy = self.down_entropies(stats.grad)
        h = float(entropy[self.legs.down.index(state.down_bits)])
        ratio, observed = state.down_ratio, state.down_observed
        if h > 0:
            observed = body / (self.inner.numel * h)
            ratio = observed if ratio <= 0 else (1 - DOWN_SMOOTHING) * ratio + DOWN_SMOOTHING * observed
        if ratio <= 0:
            return ratio, observed, None
        return ratio, observed, self.down_costs(entropy, state.down_bits, body, ratio, observed)

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
        d_ratio, d_observed, down = self.learn_down(state, stats, down_now)
        learned: dict[str, Any] = {}
        if self.coded:  # the coded uplink's entropy and ratio learn from the uplink's share of the spend
            c: Any = p
            up_stats = replace(stats, spent_bits=int(stats.spent_bits) - down_now)
            learned = dict(zip(("entropy", "ratio", "observed"), c.learn(state, up_stats)))
        if step >= p.total_steps:
            return replace(state, spent=spent, fit=fit, down_ratio=d_ratio, down_observed=d_observed, **learned)
        est = upper = self.upper_up()
        if self.coded:  # floored above the width just sent, as the coded policy's own estimates
            est, upper = c.estimates(*learned.values(), state.bits, up_stats.spent_bits, c.resolution(stats.grad))
        q = self.legs.q
        xs, ys = frontier(self.costs(est, None if down is None else down[0]), q, self.legs.equivalent_bits(q),
                          p.numel / 16)
        forecast = forecast_norms(fit, stats.step, step + 1, p.total_steps, stats.norm, p.tau)
        left = float(p.budget_bits - spent)
        k, real = p.solve_widths(step, stats.norm, forecast, lambda w: float(np.interp(w, xs, ys).sum()), left)
        cap = left - (p.total_steps - step - 1) * self.costs(upper, None if down is None else down[1]).min()
        nearest = int(np.argmin(np.abs(xs - real)))  # the Pareto pair nearest the planned B_eq (first of a tie)
        u, v = self.pick(min(float(ys[nearest]), cap), cap, est, upper, down)
        return SplitState(u, v, real, spent, fit, k, down_ratio=d_ratio, down_observed=d_observed, **learned)


def split_budget(inner: Any, budget_bits: int, uplink_bits: Any, down: tuple[int, ...], down_bits: tuple[int, ...],
                 workers: int, coded_down: bool = False, down_floor: float = 0.0) -> SplitBudget:
    """``inner`` (a budgeted policy) choosing both legs: its budget ``budget_bits`` (both legs), its
    cost of an uplink width ``uplink_bits(u)`` (one worker's W shard payloads, exact fixed size);
    ``coded_down``: the downlink is coded (``auto``), ``down_bits`` its fixed sizes, ``down_floor`` its headers."""
    if not isinstance(inner, BudgetedDQSGD):
        raise ValueError(f"downlink_bits = 'auto' splits a budget between the legs: it needs a budgeted policy "
                         f"(dqsgd-budget or dqsgd-coded), not {getattr(inner, 'name', inner)!r}; give an integer width")
    planner = replace(inner, budget_bits=int(budget_bits), message_bits=uplink_bits)
    return SplitBudget(planner, LegCosts(tuple(range(inner.min_bits, inner.max_bits + 1)), down, down_bits, workers,
                                         coded_down, down_floor))
