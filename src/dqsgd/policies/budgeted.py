"""Budgeted DQSGD: the user gives a total budget C (bits per worker) instead of k or t.

DQSGD solves  min Σ_n w_n‖g_n‖²/s_n²  s.t.  Σ_n (d·B_n + B_pre) = C  [text, §4.3–4.4], whose
solution is B_n = log2(k·a_n·‖g_n‖ + 1) + 1 with a_n = α^((N−n)/2) (convex, eq. 18) or a_n = 1
(non-convex, eq. 20) and k set by C. Since future norms are unknown, we solve for k *online*
[OC]: before step n (having seen ‖G_{n−1}‖), choose k so that

    cost(B_n(k; ‖G_{n−1}‖)) + Σ_{j>n} cost(B_j(k; ĝ)) = C − spent,

where ĝ_j forecasts the future norms with a damped log-linear trend: an exponentially weighted
least-squares line through log‖G_n‖ (forgetting time τ = max(10, N/20) steps), extrapolated at most
τ steps ahead and then held flat, and kept within the observed log-range ± log 4. B_n is rounded
to the nearest integer; the per-step re-solve (not error diffusion, whose ±1 jitter decorrelates
the widths from the norms) makes the total land on C.

Why this forecast (measured, ``benchmarks/budget_forecast.py``): on synthetic norm sequences with
AR(1) noise, the quantization term Σ‖g_n‖²/s_n² relative to fixed bits at the same budget was
0.88 (decaying norms), 1.00 (fast decay then plateau), 0.97 (rising), 1.12 (flat noise), 1.15
("NN-like": fast drop, slow drift). Forecasts that react faster (short windows, full-horizon
extrapolation) were up to 5x *worse* than fixed bits, because a high current norm raised the
forecast and so lowered k. The same rule with a hindsight constant (t known in advance) reached
0.32 / 0.65 / 0.54 / 0.98 / 0.68 on the same five: that is DQSGD's gain when t is
tuned, as in the paper's Table 3, and what ``dqsgd-nonconvex`` / ``dqsgd-convex`` offer.

Side traffic. Where a step sends bytes beyond the payloads that a fixed-width method does not send (a
coded method's size table in every engine; FSDP's entropy sample: :mod:`dqsgd.policies.coded`),
``side_bits`` is what one worker sends of them per step: each step then costs ``step_bits(B)`` =
``message_bits(B)`` + ``side_bits`` in every plan and check below, and the exchange adds them to
each step's ``spent_bits`` (:meth:`dqsgd.topology.bucket.BucketProtocol.charge_side`; they are fixed
by W, the topology and the coding, and equal the bytes handed to the collectives: tested). The ledger's
byte counts stay the payloads'; a fixed-size coding has ``side_bits = 0``.

Guarantees (tested): the budget is never overspent — B_n is capped so that the steps left can
still be paid at min_bits — and the integer widths (rounded to nearest, re-solved every step) make the total land
within one step's granularity of C when C is reachable.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, ClassVar

import numpy as np

from dqsgd.policies.base import GradStats, Rounding, Spent, integerize, split_spent
from dqsgd.theory.formulas import bits_for_levels


@dataclass(frozen=True)
class BudgetState:
    bits: int             # width for the next step
    real_bits: float      # real width behind it
    spent: int            # bits one worker has sent so far (measured)
    fit: tuple[float, ...]  # decayed sums (S0, Σn, Σn², Σy, Σn·y) and (min y, max y), y = log‖G_n‖ > 0
    k: float              # the last solved constant (reported, not needed to continue)


@dataclass(frozen=True)
class BudgetedDQSGD:
    budget_bits: int
    total_steps: int
    numel: int
    message_bits: Callable[[int], int] = field(compare=False)
    convex: bool = False
    alpha: float = 1.0
    min_bits: int = 2
    max_bits: int = 16
    name: str = "dqsgd-budget"
    needs_grad: bool = False
    side_bits: int = 0  # bits one worker sends per step beyond its payloads, paid from the budget (docstring)
    label: ClassVar[str] = "budgeted DQSGD"  # how error messages name the policy

    def __post_init__(self) -> None:
        what = self.label
        if self.total_steps < 1:
            raise ValueError(f"{what}: total_steps must be >= 1, got {self.total_steps}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"{what}: alpha must be in (0, 1], got {self.alpha}")
        if not 2 <= self.min_bits <= self.max_bits <= 16:
            raise ValueError(f"{what}: need 2 <= min_bits <= max_bits <= 16")
        self.check_feasible()

    def check_feasible(self) -> None:
        """Refuse a budget that cannot pay every step at min_bits (sizes known in advance)."""
        need = self.total_steps * self.step_bits(self.min_bits)
        if self.budget_bits < need:
            raise ValueError(
                f"infeasible budget: {self.budget_bits} bits cannot pay {self.total_steps} steps even at "
                f"min_bits={self.min_bits} ({self.step_bits(self.min_bits)} bits per step: its message and "
                f"{self.side_bits} of side traffic; {need} in all)"
            )

    def step_bits(self, bits: int) -> int:
        """What a step at width ``bits`` costs the budget: its message and the step's side traffic."""
        return self.message_bits(bits) + self.side_bits

    @property
    def header_bits(self) -> float:
        """B_pre: bits of a step beyond d·B (header, norm, CRC, side traffic), from the exact cost."""
        return self.step_bits(self.min_bits) - self.numel * self.min_bits

    def init(self) -> BudgetState:
        per_step = self.budget_bits / self.total_steps
        real = (per_step - self.header_bits) / max(self.numel, 1)
        bits = self._affordable(max(self.min_bits, min(self.max_bits, math.floor(real))), 0, 0)
        return BudgetState(bits, real, 0, (0.0, 0.0, 0.0, 0.0, 0.0, math.inf, -math.inf), float("nan"))

    def _affordable(self, bits: int, step: int, spent: int) -> int:
        """The largest width ≤ bits such that the remaining steps can still be paid at min_bits."""
        left = self.budget_bits - spent - (self.total_steps - step - 1) * self.step_bits(self.min_bits)
        while bits > self.min_bits and self.step_bits(bits) > left:
            bits -= 1
        return bits

    def solve_k(self, step: int, norm: float, forecast: np.ndarray, remaining: float) -> tuple[float, float]:
        """(k, real B_step) so that the planned spend of steps step..N−1 equals ``remaining``.

        ``norm`` is the latest ‖G‖ (drives B_step); ``forecast`` the norms of steps step+1..N−1.
        """
        m = self.total_steps - step
        target = (remaining - m * self.header_bits) / max(self.numel, 1)  # Σ_j B_j to hit
        return self.solve_widths(step, norm, forecast, lambda widths: float(widths.sum()), target)

    def solve_widths(self, step: int, norm: float, forecast: np.ndarray, total: Callable[[np.ndarray], float],
                     target: float) -> tuple[float, float]:
        """(k, real B_step) with ``total(B_step..B_{N−1} at k) = target`` (:func:`solve_log_k`), the
        widths planned from ``norm`` (the latest ‖G‖) and ``forecast`` (the norms of steps step+1..N−1)."""
        widths = self.planned_widths(step, np.concatenate([[norm], forecast]).astype(np.float64))
        k = solve_log_k(lambda logk: total(widths(math.exp(logk))), target)
        return k, widths.first(k)

    def planned_widths(self, step: int, norms: np.ndarray) -> PlannedWidths:
        """B_j(k) of steps step..N−1 given their norms (the latest first), for the bisection on k."""
        scales = _decay(self.alpha, self.total_steps)[step:] if self.convex else None
        return PlannedWidths(norms, scales, self.min_bits, self.max_bits)

    def observe(self, state: BudgetState, stats: GradStats) -> tuple[int, int, tuple[float, ...]]:
        """(the next step, bits spent including step ``stats.step``, the norm forecast's sums with its norm)."""
        fit = state.fit
        if stats.norm > 0:
            fit = _observe(fit, float(stats.step), math.log(stats.norm), 1.0 - 1.0 / self.tau)
        return stats.step + 1, state.spent + int(stats.spent_bits), fit

    def update(self, state: BudgetState, stats: GradStats) -> BudgetState:
        step, spent, fit = self.observe(state, stats)
        if step >= self.total_steps:
            return replace(state, spent=spent, fit=fit)
        forecast = forecast_norms(fit, stats.step, step + 1, self.total_steps, stats.norm, self.tau)
        k, real = self.solve_k(step, stats.norm, forecast, self.budget_bits - spent)
        bits, _ = integerize(real, Rounding.NEAREST, 0.0, self.min_bits, self.max_bits)
        return BudgetState(self._affordable(bits, step, spent), real, spent, fit, k)

    @property
    def tau(self) -> float:
        """Forgetting time and extrapolation horizon of the norm forecast, in steps."""
        return max(10.0, self.total_steps / 20.0)


def replace_budget(policy: object, **changes: object) -> object | None:
    """``policy`` with ``changes`` made to its budgeted policy (itself, or the ``inner`` of the both-leg
    split); None where it has no budget."""
    if isinstance(policy, BudgetedDQSGD):
        return replace(policy, **changes)
    inner = getattr(policy, "inner", None)
    return replace(policy, inner=replace(inner, **changes)) if isinstance(inner, BudgetedDQSGD) else None


def charged_spent(spent: Spent, side_bits: int) -> Spent:
    """A step's :data:`~dqsgd.policies.base.Spent` with ``side_bits`` of side traffic added to its total."""
    total, down = split_spent(spent)
    return total + side_bits if down is None else (total + side_bits, down)


def solve_log_k(total: Callable[[float], float], target: float) -> float:
    """k with ``total(log k) = target`` by bisection on log k in [−80, 80]; ``total`` must be
    non-decreasing in log k (a sum of DQSGD widths, or of their costs). Clamped at the ends.

    At most 100 halvings; it stops, without evaluating ``total``, once the mid rounds to lo or hi
    (after about 55 halvings in double precision, when they are adjacent floats). Whichever side the
    halving would then keep, the pair stays or becomes (mid, mid), and every later halving repeats it,
    so the result exp((lo + hi)/2) is exp(mid) either way: the one the 100 halvings give."""
    lo, hi = -80.0, 80.0
    if total(hi) <= target:
        return math.exp(hi)
    if total(lo) >= target:
        return math.exp(lo)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if mid == lo or mid == hi:
            break
        lo, hi = (mid, hi) if total(mid) < target else (lo, mid)
    return math.exp(0.5 * (lo + hi))


class PlannedWidths:
    """B_j(k) = clip(log2(k·a_j·‖g_j‖ + 1) + 1, min_bits, max_bits) for fixed norms, at any k: the width
    rule :func:`dqsgd.theory.bits_for_levels`, evaluated in place.

    The bisection evaluates this some 55 times per step, so it writes into one buffer with the ufuncs'
    ``out=`` instead of allocating six arrays and going through ``np.clip``'s Python wrapper, and it
    skips the product with a_j where every a_j is 1.0 (non-convex: k·1.0·‖g‖ is k·‖g‖ exactly). Each
    element sees the same floating-point operations in the same order as
    ``np.clip(np.log2(k * scales * norms + 1.0) + 1.0, min_bits, max_bits)`` — max then min is what
    clip computes — so the widths, and their sum over the same contiguous array, are bit for bit the
    same.

    Non-convex, the forecast is flat beyond its horizon: the norms end in a run of one value, whose
    width is computed once and copied over the run (the ufuncs work elementwise, so each copy is the
    value they would have computed there).
    """

    def __init__(self, norms: np.ndarray, scales: np.ndarray | None, min_bits: int, max_bits: int) -> None:
        self.norms = np.ascontiguousarray(norms, dtype=np.float64)
        self.scales = scales  # a_j; None when all are 1.0
        self.lo, self.hi = float(min_bits), float(max_bits)
        self.out = np.empty_like(self.norms)
        head = self.norms.size if scales is not None else _head(self.norms)
        self.head_norms, self.head_out, self.tail_out = self.norms[:head], self.out[:head], self.out[head:]

    def __call__(self, k: float) -> np.ndarray:
        """The widths at ``k``, in a buffer that the next call overwrites."""
        out = self.head_out
        if self.scales is None:
            np.multiply(self.head_norms, k, out=out)
        else:
            np.multiply(self.scales, k, out=out)
            np.multiply(out, self.head_norms, out=out)
        np.add(out, 1.0, out=out)
        np.log2(out, out=out)
        np.add(out, 1.0, out=out)
        np.maximum(out, self.lo, out=out)
        np.minimum(out, self.hi, out=out)
        if self.tail_out.size:
            self.tail_out.fill(out[-1])
        return self.out

    def first(self, k: float) -> float:
        """The real width of the first step alone (the one the policy turns into an integer)."""
        scale = 1.0 if self.scales is None else float(self.scales[0])
        x = np.array([k * scale * float(self.norms[0])])
        return float(np.clip(bits_for_levels(x, np.log2), self.lo, self.hi)[0])


def _head(norms: np.ndarray) -> int:
    """How many leading norms to compute: all but the trailing run of bit-identical copies of the last."""
    if norms.size < 2:
        return norms.size
    bits = norms.view(np.int64)
    differs = np.flatnonzero(bits != bits[-1])
    return int(differs[-1]) + 2 if differs.size else 1


@functools.lru_cache(maxsize=4)
def _decay(alpha: float, total_steps: int) -> np.ndarray:
    """a_j = α^((N−j)/2) for j = 0..N−1, computed once per (α, N) and sliced per step (elementwise the
    same values as computing them for j = step..N−1 each time); read-only."""
    js = np.arange(0, total_steps, dtype=np.float64)
    scales = alpha ** ((total_steps - js) / 2.0)
    scales.setflags(write=False)
    return scales


def _observe(fit: tuple[float, ...], n: float, y: float, lam: float) -> tuple[float, ...]:
    s0, s1, s2, sy, sny, lo, hi = fit
    return (lam * s0 + 1, lam * s1 + n, lam * s2 + n * n, lam * sy + y, lam * sny + n * y, min(lo, y), max(hi, y))


def trend_count(tau: float) -> float:
    """The decayed count S0 from which the forecast fits a slope: min(10, τ), or, where S0 can never reach it
    (τ = 10: S0 = τ·(1 − λ^n) < τ with λ = 1 − 1/τ), the S0 of ten observations, τ·(1 − λ^10).

    Without the second case a run of N ≤ 200 steps (τ = 10: every Local SGD run of up to 200 rounds) never
    used the trend: its forecast stayed flat at the weighted mean of the past norms."""
    if tau > 10.0:
        return min(10.0, tau)
    return tau * (1.0 - (1.0 - 1.0 / tau) ** 10) * (1.0 - 1e-12)  # ten observations, whatever the rounding


def forecast_norms(fit: tuple[float, ...], last: int, start: int, stop: int, fallback: float, tau: float) -> np.ndarray:
    """Norms of steps start..stop−1: the damped trend of the module docstring (flat before 10 points)."""
    s0, s1, s2, sy, sny, lo, hi = fit
    js = np.arange(start, stop, dtype=np.float64)
    if s0 == 0:
        return np.full(js.size, fallback)
    det = s0 * s2 - s1 * s1
    slope = (s0 * sny - s1 * sy) / det if s0 >= trend_count(tau) and det > 1e-12 else 0.0
    level = sy / s0 + slope * (last - s1 / s0)
    logs = level + slope * np.minimum(js - last, tau)
    return np.exp(np.clip(logs, lo - math.log(4.0), hi + math.log(4.0)))
