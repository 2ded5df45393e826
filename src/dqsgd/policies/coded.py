"""Byte-budgeted DQSGD (``dqsgd-coded``): the budget C counts *entropy-coded* bits on the wire.

:class:`~dqsgd.policies.budgeted.BudgetedDQSGD` charges a width B the fixed-width message size
B_pre + d·B. With an entropy coding (``coding = "auto"``: the smallest of fixed, Elias, zstd and
rANS) a message of B-bit levels costs far less — about d·H_B, H_B the entropy of its levels, which
for stochastic max-norm levels of a gradient is well under B (and grows by far less than one bit
per extra bit of width, since most coordinates sit near zero). This policy chooses B_n by the same
error bound — B_j(k) = log2(k·a_j·ĝ_j + 1) + 1, the k solved online so that the planned spend of the
remaining steps equals the remaining budget — but costs each candidate width by its *predicted
coded size*:

    cost(B) = min(fixed(B), B_pre + r · d · H_B(G_n))

* H_B(G_n): the expected entropy (bits per coordinate) of the signed levels that stochastic
  rounding of the latest aggregate G_n at width B would produce — computed exactly from the
  rounding probabilities (level ⌊u·s⌋ with probability 1 − frac, ⌊u·s⌋ + 1 with probability frac,
  u = |G_i| / ‖G‖_p), on a fixed stride of at most ``sample`` coordinates;
* r: a running ratio (exponential average, weight ``smoothing``) of the real payload bits beyond the
  header — what the ledger measured for step n, ``spent_bits`` — to the predicted d·H_{B_n}. It
  absorbs what the entropy of G does not see: a worker's gradient is noisier than the average,
  and a coding has tables and flushes.
* fixed(B): the exact FIXED size, which ``auto`` never exceeds.

Between integer widths the cost is interpolated linearly, so the planned total is continuous and
non-decreasing in k and a bisection finds k (:func:`~dqsgd.policies.budgeted.solve_log_k`, shared
with the nominal budget). B_n is the nearest integer, lowered while the step and a reserve for the
remaining steps at ``min_bits`` would overspend C. Every cost in that check is an upper estimate:
``margin`` × the larger of r and the last observed ratio, or fixed(B) when that is smaller.

Side traffic and the sample (FSDP; :attr:`BudgetedDQSGD.side_bits`). A coded message's size is not
known in advance, so the engines all-gather a size table every step (S int64 to each peer): a
fixed-width method sends none. Under FSDP no rank holds G, so the ranks also all-gather their pieces
of the entropy sample, 4 bytes per sampled coordinate, in the status message every rank sends anyway
(its first 256 bytes are room a fixed width sends too, for a refusal). The size tables are charged to
the budget in every engine, FSDP's sample too, and the sample shrinks with the unit (:func:`fit_sample`): it is the largest (at most ``sample``) whose bytes past that room
cost at most 1/16 of a step's share C/N. Why: on a unit of 10⁴ elements over 4 ranks the full sample
(every coordinate) sent 30 kB a step against a 1.4 kB budget share and the 4.6 kB of ``qsgd-4bit``;
1/16 leaves the levels at least 15/16 of the budget and still samples ~d/500 coordinates (more than
60 per rank fit the room for free), enough for an entropy whose bias the ratio r absorbs. The DDP
hook's ranks hold G: its sample costs nothing and stays; its size tables are charged as the trainer's
and the simulation's are (one engine, the same widths). No fallback to the uncoded budget is needed:
what the charge leaves the levels (at least ≈ 0.6 bits per coordinate at 10⁴ elements and W = 8)
still buys more than a FIXED budget could (2 bits at the least).

What is guaranteed, and what is measured: the sizes of coded messages are only known once they are
encoded, so unlike the nominal budget (where every size is known in advance) the "never overspent"
property rests on the reserve's margin, not on arithmetic. ``tests/policies/test_policy_coded.py`` trains
real models through the simulation and checks that the ledger's coded bytes never exceed C and land
within 1% of it (N ≥ 100).

Widths G resolves. Above the width B_n just sent, each width costs at least the measured message; above
R, the widest width whose levels the distinct magnitudes of G's entropy sample can fill (s_R ≤ K), at
least the cost at max(B_n, R) plus one bit per coordinate per extra bit: there H_B(G) stops growing while
a worker's own vector gains about a bit per coordinate per bit of width. The mean of W messages of
different scales lies on a lattice about W times finer than one message, and a v-bit downlink caps it
(R = 10 after ``local-fashion``'s 8-bit sharded downlink), so below R the entropy of G is the estimate.

The first step. Before any message no entropy is known, so the first width cannot be costed; charging it
at its fixed size (the largest width whose fixed size fits C/N) gives ``min_bits`` at every coded budget
under 2 bits per coordinate, whatever the data. The bound's term of a step is the variance of the mean of
the workers' messages, Σ_w d‖g_w‖∞²/(4W²s²): the workers' norms, not their mean's. Where the workers
disagree (the first round of Local SGD on a Dirichlet(0.1) split: worker ∞-norms 10× the mean's) the
``min_bits`` mean is mostly noise, E‖G − ḡ‖² = 41‖ḡ‖², and DiLoCo's outer momentum carries it on
(docs/algorithms.md §11.5a). So the first width is the method's start width B_0 (``start_bits``, the config's
``bits``, as for the closed-form rules), never below the share rule's, lowered while its fixed size and
the headers of the N − 1 later messages would exceed C; its coded size is then learned like any other.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Callable, ClassVar

import numpy as np
import torch

from dqsgd.kernels.levels import value_level_entropies
from dqsgd.policies.base import GradStats, Rounding, integerize
from dqsgd.policies.budgeted import BudgetedDQSGD, forecast_norms, replace_budget
from dqsgd.quantizers.constants import levels_for_bits


@dataclass(frozen=True)
class CodedBudgetState:
    bits: int                   # width for the next step
    real_bits: float            # real width behind it
    spent: int                  # coded bits one worker has sent so far (measured: max over workers)
    fit: tuple[float, ...]      # the norm forecast's decayed sums (as BudgetedDQSGD)
    k: float                    # the last solved constant
    entropy: tuple[float, ...]  # H_B(G) for B = min_bits..max_bits, bits per coordinate (empty: none yet)
    ratio: float                # running real / predicted body bits (nan: no observation yet)
    observed: float             # the last observed ratio (nan: none)


def sample_stride(numel: int, sample: int) -> int:
    """The stride of :func:`level_entropies`' sample of a vector of ``numel``: ⌈numel/sample⌉ (at least 1).

    A vector that is already that sample, ``v[::sample_stride(n, sample)]``, has ⌈n/stride⌉ ≤ ``sample``
    elements, so its own stride is 1 and its entropies are the whole vector's, bit for bit: a caller
    that keeps the sample alone (the DDP hook's :meth:`~dqsgd.ddp.state.BucketState.record`) feeds the
    policy the same numbers as one that keeps the vector."""
    return max(1, -(-numel // sample))


def read_stride(policy: object, numel: int) -> int:
    """The stride of the part of a vector of ``numel`` that ``policy`` reads of G: the coded budget's
    entropy sample (:func:`sample_stride`; under ``downlink_bits = "auto"`` it is the split policy's
    ``inner``), else 1 (all of it, as AdaQS reads it)."""
    sample = getattr(getattr(policy, "inner", policy), "sample", None)
    return 1 if sample is None else sample_stride(numel, sample)


SIDE_SHARE = 16  # FSDP's entropy sample may cost at most 1/SIDE_SHARE of a step's budget share (module docstring)


def fit_sample(policy: object, extra: Callable[[int], int]) -> object:
    """``policy`` (a coded budget, or the both-leg split over one; else as it is) with its ``sample`` cut to
    the largest whose exchange costs at most 1/:data:`SIDE_SHARE` of a step's budget share: ``extra(n)``,
    the bytes a sample of at most n coordinates adds to one rank's step, is non-decreasing in n."""
    inner = getattr(policy, "inner", policy)
    if not isinstance(inner, CodedBudgetedDQSGD):
        return policy
    allow = inner.budget_bits / (8 * SIDE_SHARE * inner.total_steps)
    lo, hi = 1, inner.sample
    if extra(hi) <= allow:
        return policy
    while lo < hi:  # the largest n in [lo, hi) with extra(n) <= allow (extra(1) is a few bytes: none past the room)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if extra(mid) <= allow else (lo, mid - 1)
    return replace_budget(policy, sample=lo)


def level_entropies(grad: torch.Tensor, norm: float, widths: range, sample: int = 1 << 16) -> list[float]:
    """Expected entropy, bits per coordinate, of the signed levels of unbiased stochastic rounding of
    ``grad`` at each width in ``widths`` (scale ``norm``: u = |g|/norm, s = 2^(B−1) − 1 levels).

    Exact in the rounding probabilities, over a fixed stride of at most ``sample`` coordinates
    (deterministic: no draw). A zero vector has entropy 0 at every width."""
    g = grad.detach().reshape(-1)
    if g.numel() == 0 or not norm > 0:
        return [0.0] * len(widths)
    g = g[:: sample_stride(g.numel(), sample)].cpu()  # only the sample is copied
    if g.dtype not in (torch.float32, torch.float64):
        g = g.to(torch.float32)  # exact: the scale and magnitudes are float64 (value_level_entropies)
    return value_level_entropies(g.contiguous().numpy(), float(norm), [levels_for_bits(b) for b in widths])


@dataclass(frozen=True)
class CodedBudgetedDQSGD(BudgetedDQSGD):
    """``budget_bits``: C in coded bits per worker over the run; ``message_bits(B)``: the exact FIXED
    size of a message at width B (an upper bound of the coded size). See the module docstring."""

    name: str = "dqsgd-coded"
    needs_grad: bool = True
    label: ClassVar[str] = "coded DQSGD"
    sample: int = 1 << 16
    smoothing: float = 0.3
    margin: float = 1.1
    start_bits: int | None = None  # B_0, the method's start width (None: the share rule alone; module docstring)

    def check_feasible(self) -> None:
        """Refuse bad knobs, and a budget that cannot even pay the headers (coded sizes are not known
        in advance: the levels' share is checked by the reserve at every step)."""
        if not (0 < self.smoothing <= 1 and self.margin >= 1 and self.sample >= 1):
            raise ValueError("coded DQSGD: need 0 < smoothing <= 1, margin >= 1, sample >= 1")
        if self.start_bits is not None and not self.min_bits <= self.start_bits <= self.max_bits:
            raise ValueError(f"coded DQSGD: start_bits {self.start_bits} outside [min_bits, max_bits] = "
                             f"[{self.min_bits}, {self.max_bits}]")
        need = self.total_steps * self.header_bits
        if self.budget_bits <= need:
            raise ValueError(
                f"infeasible coded budget: {self.budget_bits} bits cannot pay the headers of {self.total_steps} "
                f"messages ({self.header_bits:g} bits each, {need:g} in all), let alone their levels")

    @property
    def widths(self) -> range:
        return range(self.min_bits, self.max_bits + 1)

    @functools.cached_property
    def fixed_bits(self) -> np.ndarray:
        """fixed(B) for B = min_bits..max_bits (read-only): every update reads it several times, and
        ``message_bits`` builds a header's size on each call."""
        fixed = np.array([self.step_bits(b) for b in self.widths], dtype=np.float64)
        fixed.setflags(write=False)
        return fixed

    def init(self) -> CodedBudgetState:
        bits = self.first_bits()
        return CodedBudgetState(bits, float(bits), 0, (0.0, 0.0, 0.0, 0.0, 0.0, math.inf, -math.inf), float("nan"),
                                (), float("nan"), float("nan"))

    def first_bits(self) -> int:
        """B_0: the larger of the share rule's width (the largest whose fixed size fits C/N) and the start
        width ``start_bits``, lowered while its fixed size and the headers of the N − 1 later messages would
        exceed C (module docstring, "The first step")."""
        share = self.budget_bits / self.total_steps
        bits = self.min_bits
        while bits < self.max_bits and self.step_bits(bits + 1) <= share:
            bits += 1
        start = max(bits, self.start_bits or bits)
        later = (self.total_steps - 1) * self.header_bits
        while start > bits and self.step_bits(start) + later > self.budget_bits:
            start -= 1
        return start

    def costs(self, entropy: tuple[float, ...], ratio: float) -> np.ndarray:
        """Predicted coded bits of one message at each width min..max: non-decreasing, ≤ fixed(B)."""
        fixed = self.fixed_bits
        if not entropy or not math.isfinite(ratio):
            return fixed
        coded = self.header_bits + ratio * self.numel * np.asarray(entropy, dtype=np.float64)
        return np.maximum.accumulate(np.minimum(fixed, coded))

    def upper_costs(self, entropy: tuple[float, ...], ratio: float, observed: float) -> np.ndarray:
        """The reserve's upper estimate of each width's coded bits: ``margin`` × the larger of r and the
        last observed ratio (the fixed size where that is smaller)."""
        return self.costs(entropy, self.margin * max(ratio, observed) if math.isfinite(observed) else ratio)

    def estimates(self, entropy: tuple[float, ...], ratio: float, observed: float, measured: int,
                  spent_bits: int, resolved: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(predicted, upper) coded bits of each width after a message at width ``measured`` that cost
        ``spent_bits``: :meth:`costs` and :meth:`upper_costs`, each floored by :meth:`above_measured` (above
        ``resolved``, the widest width G resolves: :meth:`resolution`; None: the measured width)."""
        return (self.above_measured(self.costs(entropy, ratio), measured, spent_bits, 1.0, resolved),
                self.above_measured(self.upper_costs(entropy, ratio, observed), measured, spent_bits, self.margin,
                                    resolved))

    def above_measured(self, cost: np.ndarray, measured: int, spent_bits: int, margin: float,
                       resolved: int | None = None) -> np.ndarray:
        """``cost`` raised, above the width ``measured`` just sent, to the measured body bits (× ``margin``),
        and above the widest width G resolves, a = max(measured, ``resolved``), to the cost at a plus one bit
        per coordinate per extra bit of width (× ``margin``), capped by fixed(B).

        Above a, G's levels do not resolve, so H_B(G) stops growing while a worker's own vector still
        gains about one bit per coordinate for every bit of width (each level splits in two). Without the
        floor, a round after a 2-bit round was costed at 16 bits as 53 kbit and sent 784 kbit. Below a, the
        entropy of G tracks the workers' (module docstring, "Widths G resolves")."""
        if not math.isfinite(spent_bits) or spent_bits <= 0:
            return cost
        widths = np.arange(self.min_bits, self.max_bits + 1, dtype=np.float64)
        anchor = measured if resolved is None else min(self.max_bits, max(measured, resolved))
        body = self.header_bits + margin * max(0.0, spent_bits - self.header_bits)  # the measured message
        at_anchor = body if anchor == measured else max(body, float(cost[anchor - self.min_bits]))
        above = at_anchor + margin * self.numel * (widths - anchor)
        floor = np.where(widths > anchor, above, np.where(widths > measured, body, 0.0))
        fixed = self.fixed_bits
        return np.maximum.accumulate(np.maximum(cost, np.minimum(floor, fixed)))

    def resolution(self, grad: torch.Tensor) -> int:
        """The widest width whose levels the magnitudes of G's entropy sample can fill: the largest B with
        s_B = 2^(B−1) − 1 ≤ K, K the number of distinct nonzero |G_i| in the sample (at least ``min_bits``)."""
        g = grad.detach().reshape(-1)
        g = g[:: sample_stride(g.numel(), self.sample)]
        k = int(torch.count_nonzero(torch.unique(g.abs())))
        bits = self.min_bits
        while bits < self.max_bits and levels_for_bits(bits + 1) <= k:
            bits += 1
        return bits

    def solve_coded_k(self, step: int, norm: float, forecast: np.ndarray, cost: np.ndarray,
                      remaining: float) -> tuple[float, float]:
        """(k, real B_step) so that the predicted coded spend of steps step..N−1 — each width costed by
        ``cost`` (per width min..max), interpolated between integers — equals ``remaining``."""
        grid = np.arange(self.min_bits, self.max_bits + 1, dtype=np.float64)
        return self.solve_widths(step, norm, forecast, lambda widths: float(np.interp(widths, grid, cost).sum()),
                                 remaining)

    def learn(self, state: CodedBudgetState, stats: GradStats) -> tuple[tuple[float, ...], float, float]:
        """(H_B(G) per width, running ratio r, observed ratio) after step ``stats.step``, whose uplink was
        sent at ``state.bits`` and cost ``stats.spent_bits`` (the uplink's bits alone)."""
        if stats.grad is None:
            raise ValueError("coded DQSGD needs the aggregated gradient in GradStats.grad (needs_grad = True)")
        entropy = tuple(level_entropies(stats.grad, stats.norm, self.widths, self.sample))
        ratio, observed = state.ratio, state.observed
        predicted = self.numel * entropy[state.bits - self.min_bits]
        if predicted > 0:
            observed = max(0.0, stats.spent_bits - self.header_bits) / predicted
            ratio = observed if not math.isfinite(ratio) else (1 - self.smoothing) * ratio + self.smoothing * observed
        return entropy, ratio, observed

    def update(self, state: CodedBudgetState, stats: GradStats) -> CodedBudgetState:  # type: ignore[override]
        step, spent, fit = self.observe(state, stats)  # type: ignore[arg-type]
        entropy, ratio, observed = self.learn(state, stats)
        if step >= self.total_steps:
            return replace(state, spent=spent, fit=fit, entropy=entropy, ratio=ratio, observed=observed)
        cost, upper = self.estimates(entropy, ratio, observed, state.bits, stats.spent_bits,
                                     self.resolution(stats.grad))  # type: ignore[arg-type]
        forecast = forecast_norms(fit, stats.step, step + 1, self.total_steps, stats.norm, self.tau)
        k, real = self.solve_coded_k(step, stats.norm, forecast, cost, float(self.budget_bits - spent))
        bits, _ = integerize(real, Rounding.NEAREST, 0.0, self.min_bits, self.max_bits)
        reserve = (self.total_steps - step - 1) * upper[0]
        while bits > self.min_bits and spent + upper[bits - self.min_bits] + reserve > self.budget_bits:
            bits -= 1
        return CodedBudgetState(bits, real, spent, fit, k, entropy, ratio, observed)
