"""What the exchange gathers for a policy fed the workers' norms (the link policy,
:mod:`dqsgd.policies.link`): each rank's ‖g_r‖² and the realized rounding error of its own uplink
message, riding in the size all-gather, and the sums every rank then hands the policy (the same on
every rank: summed in rank order from the same float64 bit patterns)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dqsgd.quantizers.constants import levels_for_bits
from dqsgd.topology.group import UP, then

if TYPE_CHECKING:
    from dqsgd.topology.bucket import BucketProtocol
    from dqsgd.topology.group import Group

__all__ = ["figures_table", "observes", "own_figures", "worker_sums"]


def observes(policy: object, step: int) -> bool:
    """Whether ``policy`` takes the statistics of step ``step`` (the link policy: every ``every``-th step,
    :meth:`~dqsgd.policies.link.LinkPolicy.observes`; every other policy: every step). Between them the
    caller gathers no figures and records nothing for it."""
    f = getattr(policy, "observes", None)
    return True if f is None else bool(f(step))


def figures_table(group: Group, mine: list[int], figures: list[float], device: torch.device) -> Any:
    """The size table gathered whatever the widths, each rank's row followed by its float64
    ``figures`` (their bit patterns, as int64: lossless): a future of (the size table, every rank's figures)."""
    k = len(mine)
    t = torch.cat([torch.tensor(mine, dtype=torch.int64), torch.tensor(figures, dtype=torch.float64).view(torch.int64)])

    def split(rows: list[torch.Tensor]) -> tuple[list[list[int]], list[list[float]]]:
        m = torch.stack(rows).cpu()
        return m[:, :k].tolist(), m[:, k:].contiguous().view(torch.float64).tolist()

    return then(group.all_gather(t.to(device), UP), split)


def own_figures(P: BucketProtocol, sent: list[torch.Tensor], x: torch.Tensor, bits: int) -> list[float]:
    """This rank's (‖x‖², e) with e its own rounding error (:mod:`dqsgd.policies.variance`). Where every
    shard is one max-norm segment of stochastic uniform rounding (the link policy's preset), e is the
    error's expectation given x, exactly: Σ_i Δ²·f_i(1 − f_i), Δ = max|x_shard|/s, f_i the fractional
    part of |x_i|/Δ (as :func:`~dqsgd.policies.link.rounding_variances`, over every coordinate), which
    keeps σ̂² unbiased (the realized error's mean given x) and costs a few passes over x instead of
    decoding this rank's payloads every step; elsewhere the realized ‖Q(x) − x‖², its payloads ``sent``
    decoded (in float32: within ~1e-6 relatively, far inside the estimate's own noise). ‖x‖² in float64."""
    x, err = x.float(), 0.0
    x64 = x.to(torch.float64)
    c = P.method.config
    if c.scheme == "uniform" and c.norm == "inf" and not c.bucket and not c.per_tensor and not c.error_feedback:
        levels = levels_for_bits(P.method.width(bits))
        for lo, hi in P.bounds:
            a = x[lo:hi].abs()
            step = float(a.max()) / levels if hi > lo else 0.0
            if step > 0:  # |x_i|/Δ ≤ s: its fractional part is exact to ~1e-5 in float32
                f = a.div_(step).frac_()
                err += step * step * float(f.sub_(f.square()).sum(dtype=torch.float64))
        return [float(x64.dot(x64)), err]
    for j, (lo, hi) in enumerate(P.bounds):
        e = P.reduce(j, [sent[j]], bits).sub_(x[lo:hi])
        err += float(e.dot(e))
    return [float(x64.dot(x64)), err]


def worker_sums(figures: list[list[float]], P: BucketProtocol, dbits: int, update: torch.Tensor,
                p: float) -> tuple[float, float, int]:
    """(Σ‖g_r‖², Σ_r e_r + W²·v_down, W) for :meth:`~dqsgd.topology.state.BucketState.observe`: e_r the
    ranks' realized uplink rounding errors, v_down the quantized downlink's modelled rounding variance
    (:func:`~dqsgd.policies.variance.modelled_rounding_variance`). Sums in rank order: the same on every rank."""
    from dqsgd.policies.variance import modelled_rounding_variance
    from dqsgd.quantizers.constants import levels_for_bits
    from dqsgd.topology.names import FP32

    down = 0.0
    if P.kind.sharded and dbits != FP32:
        down = modelled_rounding_variance(update, P.bounds, levels_for_bits(dbits), p)
    w = len(figures)
    return sum(f[0] for f in figures), sum(f[1] for f in figures) + w * w * down, w
