"""Widths from the link (``policy = "link"``, method ``dqsgd-link``): every step, the uplink width
(and downlink width, and coding) of least predicted time to the full-precision accuracy [OC].

docs/algorithms.md §11.5b–c. After step n the policy holds ‖G_n‖_p, the entropy H_B(G_n) of G's
stochastic levels at each width (:func:`~dqsgd.policies.coded.level_entropies`: what a coded message
of width B costs per coordinate) and σ̂², the smoothed sampling variance of the averaged gradient
(:mod:`dqsgd.policies.variance`, from the workers' norms that the caller hands over with
:meth:`LinkPolicy.observe_workers` before the step). It builds the time model of the stated figures
(:class:`~dqsgd.policies.linktime.TimeModel`: the link's ``mbit`` and latency, the compute time, the
codec's ns per coordinate of each coding — by default AUTO's own model, :data:`dqsgd.codecs.auto.CPU_NS`
— and the wire bits per coordinate: B for fixed coding, min(B, H_B(G_n)) for rANS) and takes
:func:`~dqsgd.policies.linktime.choose`'s argmin of J = ρ·T for step n+1.

Until σ̂² is known (no worker norms handed over yet, or only one worker) the width stays at the
start width; σ̂² = 0 (the workers agree exactly: no sampling noise to hide quantization noise in)
sends the widest width. The choice is a function of the stated figures and the statistics only, so
every rank that holds the same statistics takes the same one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from dqsgd.codecs.auto import CPU_NS
from dqsgd.codecs.header import Coding
from dqsgd.policies.base import GradStats
from dqsgd.policies.coded import level_entropies, sample_stride
from dqsgd.policies.linktime import UNCOMPRESSED, Choice, TimeModel, calibrated, choose, objective
from dqsgd.policies.variance import pooled_variance, smoothed
from dqsgd.quantizers.constants import levels_for_bits

__all__ = ["DEFAULT_CODEC_NS", "LinkPolicy", "LinkState", "rounding_variances"]

# The codings the policy prices, ns per coordinate (encode + decode): AUTO's model of FIXED and RANSX.
DEFAULT_CODEC_NS: tuple[tuple[str, float], ...] = (("fixed", CPU_NS[Coding.FIXED]), ("rans", CPU_NS[Coding.RANSX]))


@dataclass(frozen=True)
class LinkState:
    bits: int                   # uplink width of the next step
    down_bits: int              # downlink width of the next step (UNCOMPRESSED: the dtype)
    coding: str                 # the coding the choice was priced with ("fixed" or "rans")
    sigma2: float               # smoothed σ̂² of the averaged gradient (NaN: none yet)
    workers: int                # W of the last worker norms (0: none yet)
    pending: tuple[float, ...]  # (Σ‖g_i‖², ‖ḡ‖², W, Σ quantization variances) of the step in flight; ()
    objective: float            # J of the choice, seconds per full-precision step (NaN: none yet)


@dataclass(frozen=True)
class LinkPolicy:
    """``mbit``: the link's throughput; ``header_bits``: B_pre of one message; ``messages``: messages per
    direction over the bottleneck link; ``down_widths``: the downlink widths the caller can send;
    ``uncompressed``: whether the uplink may go in its dtype (the simulation's quantizer cannot)."""

    numel: int
    mbit: float
    header_bits: float
    start_bits: int
    # the rest of the time model: stated seconds, and the codec's ns per coordinate by coding
    compute_s: float = 0.0
    latency_s: float = 0.0
    messages: int = 1
    codec_ns: tuple[tuple[str, float], ...] = DEFAULT_CODEC_NS
    dtype_bytes: int = 4
    step_ns: tuple[tuple[str, float], ...] = ()  # measured: a compressed step's cost per coordinate beyond the
    plain_ns: float = 0.0                         # model's, by coding; an uncompressed one's
    # what may be sent
    min_bits: int = 2
    max_bits: int = 16
    down_widths: tuple[int, ...] = (UNCOMPRESSED,)
    uncompressed: bool = False
    # the statistics: σ̂²'s smoothing weight, G's entropy sample, the steps between re-evaluations
    smoothing: float = 0.3
    sample: int = 1 << 16
    every: int = 10
    name: str = "link"
    needs_grad: bool = True
    needs_worker_norms: ClassVar[bool] = True  # the caller hands over the workers' norms before each step
    label: ClassVar[str] = "link policy"

    def __post_init__(self) -> None:
        if self.numel < 1:
            raise ValueError(f"{self.label}: numel must be >= 1, got {self.numel}")
        if not 2 <= self.min_bits <= self.start_bits <= self.max_bits <= 16:
            raise ValueError(f"{self.label}: need 2 <= min_bits <= start_bits <= max_bits <= 16")
        if not 0 < self.smoothing <= 1 or self.sample < 1 or self.every < 1:
            raise ValueError(f"{self.label}: need 0 < smoothing <= 1, sample >= 1 and every >= 1 (link_every)")
        if not self.down_widths or any(w != UNCOMPRESSED and not self.min_bits <= w <= self.max_bits
                                       for w in self.down_widths):
            raise ValueError(f"{self.label}: down_widths must be {UNCOMPRESSED} (the dtype) or widths in "
                             f"[min_bits, max_bits], got {self.down_widths}")
        if not self.codec_ns or len({c for c, _ in self.codec_ns}) != len(self.codec_ns):
            raise ValueError(f"{self.label}: codec_ns names each coding once, got {self.codec_ns}")
        self.model(())  # the time model checks the figures (rate, latency, compute, costs)

    def init(self) -> LinkState:
        """The start: ``start_bits`` up; down the dtype where the caller sends it, else the widest width ≤ 8
        (the fixed downlink's default)."""
        downs = self.down_widths
        down = UNCOMPRESSED if UNCOMPRESSED in downs else max([w for w in downs if w <= 8] or [min(downs)])
        return LinkState(self.start_bits, down, self.codec_ns[0][0], math.nan, 0, (), math.nan)

    def observes(self, step: int) -> bool:
        """Whether the statistics of step ``step`` are taken (every ``every``-th step, from step 0): the
        caller gathers the workers' figures and G's sample of those steps only, and :meth:`update`
        re-evaluates the choice from them; between them every step sends the cached choice and
        computes nothing for the policy. A function of the step alone: every rank takes the same steps."""
        return step % self.every == 0

    def choosing_down(self, widths: Sequence[int]) -> LinkPolicy:
        """This policy choosing the downlink width too, among ``widths`` (``downlink_bits = "auto"``), each
        clipped to [min_bits, max_bits]."""
        downs = tuple(w for w in widths if self.min_bits <= w <= self.max_bits)
        if not downs:
            raise ValueError(f"{self.label}: no downlink width of {tuple(widths)} lies in [min_bits, max_bits] = "
                             f"[{self.min_bits}, {self.max_bits}]")
        return replace(self, down_widths=downs)

    def observe_workers(self, state: LinkState, sum_sq: float, mean_sq: float, workers: int,
                        quant_var: float = 0.0) -> LinkState:
        """The workers' norms of the step about to run (:func:`~dqsgd.policies.variance.worker_norms`;
        ``quant_var``: Σ_i of the workers' quantization variances where ``mean_sq`` is the decoded mean's);
        :meth:`update` turns them into σ̂² after the step."""
        pooled_variance(sum_sq, mean_sq, workers, quant_var)  # refuse bad figures now, not a step later
        return replace(state, pending=(float(sum_sq), float(mean_sq), float(workers), float(quant_var)))

    def sending(self, dtype_bytes: int, down_width: int | None, link: tuple[float, ...] | None = None) -> LinkPolicy:
        """This policy for a caller that can also send the bucket uncompressed, ``dtype_bytes`` per
        coordinate (the DDP hook: a plain all-reduce), and whose downlink is ``down_width`` (UNCOMPRESSED:
        the dtype; else a fixed width the policy prices but does not choose; None: the widths the policy
        chooses among, :meth:`choosing_down`); on the link the caller
        measured, ``link`` = (Mbit/s, latency s, the codec's slowdown k[, a plain step's ns per coordinate,
        ((coding, a compressed step's ns), ...)]) (:meth:`measured`), if any."""
        if down_width not in (None, UNCOMPRESSED) and not self.min_bits <= down_width <= self.max_bits:
            raise ValueError(f"{self.label}: it prices the downlink among its widths: a downlink of {down_width} "
                             f"bits needs min_bits <= {down_width} <= max_bits (here {self.min_bits}..{self.max_bits}), "
                             "or an fp32 downlink")
        downs = self.down_widths if down_width is None else (down_width,)
        policy = replace(self, uncompressed=True, dtype_bytes=dtype_bytes, down_widths=downs)
        return policy if link is None else policy.measured(link[0], link[2], *link[3:])

    def measured(self, mbit: float, slowdown: float, plain_ns: float | None = None,
                 squeezed_ns: Sequence[tuple[str, float]] = ()) -> LinkPolicy:
        """This policy on a measured link of ``mbit`` Mbit/s with the codec ``slowdown`` times AUTO's model
        (:func:`~dqsgd.policies.linktime.codec_slowdown`); with timed steps (ns per coordinate: an
        uncompressed one, and a compressed one at :meth:`init`'s widths per coding), the model calibrated to
        them (:func:`~dqsgd.policies.linktime.calibrated`)."""
        out = replace(self, mbit=mbit, codec_ns=tuple((c, v * slowdown) for c, v in self.codec_ns))
        if plain_ns is None:
            return out
        first = out.init()
        probes = [(Choice(first.bits, first.down_bits, c), ns) for c, ns in squeezed_ns]
        m = calibrated(out.model(()), self.numel, probes, plain_ns)
        return replace(out, step_ns=tuple(m.step_ns.items()), plain_ns=m.plain_ns)

    def model(self, entropy: tuple[float, ...]) -> TimeModel:
        """The time model of the stated figures with wire bits B (fixed) and min(B, H_B) (coded rows);
        ``entropy``: H_B for B = min_bits..max_bits (empty: every row at B)."""
        widths = range(1, self.max_bits + 1)
        coded = [float(b) if b < self.min_bits or not entropy else min(float(b), entropy[b - self.min_bits])
                 for b in widths]
        wire = {c: ([float(b) for b in widths] if c == "fixed" else coded) for c, _ in self.codec_ns}
        ns = {c: [v] * self.max_bits for c, v in self.codec_ns}
        return TimeModel(self.mbit, self.latency_s, self.compute_s, ns, wire, self.messages,
                         int(round(self.header_bits)), self.dtype_bytes, dict(self.step_ns), self.plain_ns)

    def decide(self, model: TimeModel, norm: float, sigma2: float, workers: int,
               q: tuple[Sequence[float], Sequence[float]] | None = None) -> tuple[Choice, float]:
        """(the argmin choice, its J) for ‖G‖ = ``norm``, σ̂² and W; ``q``: the (uplink, downlink) rounding
        variance of a message by width − 1 (None: the bound q(B))."""
        c = choose(model, d=self.numel, norm=norm, sigma2=sigma2, workers=workers, min_bits=self.min_bits,
                   max_bits=self.max_bits, uncompressed=self.uncompressed, downs=self.down_widths, q=q)
        return c, objective(model, c, d=self.numel, norm=norm, sigma2=sigma2, workers=workers, q=q)

    def update(self, state: LinkState, stats: GradStats) -> LinkState:
        if not self.observes(stats.step):  # between re-evaluations: the cached choice (figures handed over dropped)
            return replace(state, pending=()) if state.pending else state
        sigma2, workers = state.sigma2, state.workers
        if state.pending:
            s, m, w, v = state.pending
            sigma2, workers = smoothed(sigma2, pooled_variance(s, m, int(w), v), self.smoothing), int(w)
        state = replace(state, sigma2=sigma2, workers=workers, pending=())
        if math.isnan(sigma2) or not math.isfinite(stats.norm):
            return state
        if sigma2 <= 0 and self.uncompressed:  # any rounding noise costs infinitely many steps
            return replace(state, bits=UNCOMPRESSED, down_bits=UNCOMPRESSED, coding="")
        if sigma2 <= 0 or stats.norm == 0:  # nothing to hide quantization noise in / nothing to quantize
            top = UNCOMPRESSED if UNCOMPRESSED in self.down_widths else max(self.down_widths)
            return replace(state, bits=self.max_bits if sigma2 <= 0 else self.min_bits,
                           down_bits=top if sigma2 <= 0 else self.down_widths[0])
        if stats.grad is None:
            raise ValueError("the link policy needs the aggregated gradient in GradStats.grad (needs_grad = True)")
        widths = range(self.min_bits, self.max_bits + 1)
        entropy = tuple(level_entropies(stats.grad, stats.norm, widths, self.sample))
        # q(B) at G's own magnitudes for both legs (as the bound q(B) takes ‖G‖ for both)
        q = [0.0] * (self.min_bits - 1) + rounding_variances(stats.grad, stats.norm, widths, self.sample)
        choice, j = self.decide(self.model(entropy), stats.norm, sigma2, workers, (q, q))
        return replace(state, bits=choice.up, down_bits=choice.down, coding=choice.coding, objective=j)


def rounding_variances(grad: torch.Tensor, norm: float, widths: range, sample: int = 1 << 16) -> list[float]:
    """E‖Q_B(g) − g‖² of unbiased stochastic rounding of ``grad`` at each width in ``widths`` (scale
    ``norm``: step Δ_B = norm/s_B): Σ_i Δ_B²·f_i·(1 − f_i), f_i the fractional part of |g_i|/Δ_B — the
    variance of rounding |g_i| up with probability f_i. Exact over the same fixed stride of at most
    ``sample`` coordinates as :func:`~dqsgd.policies.coded.level_entropies`, scaled by d / (coordinates
    read). At most the bound d·norm²/(4·s_B²) (f(1 − f) ≤ 1/4); the bound q(B) = d·norm²/(6·s_B²) takes
    f uniform, which gradients far below their max-norm are not (there f ≈ |g|/Δ: Σ ≈ Δ·‖g‖₁)."""
    g = grad.detach().reshape(-1)
    if g.numel() == 0 or not norm > 0:
        return [0.0] * len(widths)
    x = g[:: sample_stride(g.numel(), sample)].to(torch.float64).abs().cpu()
    scale = g.numel() / x.numel()
    out = []
    for b in widths:
        step = float(norm) / levels_for_bits(b)
        f = torch.frac(x / step)
        out.append(scale * step * step * float(f.mul(1.0 - f).sum()))
    return out
