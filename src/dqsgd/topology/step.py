"""One step of DQSGD Algorithm 2 for every topology: the exchange from local gradients to the update.

The trainer calls one step object per run, ``run(transport, grads, state, step, generators)``, and
gets a :class:`StepOutcome`: the update every rank applies, the bytes that crossed the wire, the
method state after the step (error-feedback memory, the policy's B_{n+1}) and timings. One class,
:class:`ExchangeStep`, for every topology: a thin adapter from the trainer's call to one
:class:`~dqsgd.topology.exchange.Exchange` call over the transport's groups (and back), whose
topology object decides the sequence:

* ``ps`` (:mod:`dqsgd.topology.server`): every worker encodes its whole gradient, rank 0 gathers and
  averages the W payloads into G (backup workers: the first W − b arrivals), the policy picks B_{n+1}
  from G, and rank 0 broadcasts the downlink (fp32, or the signs of a majority vote) with B_{n+1};
* ``allgather``: every rank gathers every payload, averages them and runs the same policy; over
  processes the transport checks that the ranks agree (``agree``);
* ``sharded``, below.

:func:`all_finite` is the step's check of the gradients before anything is encoded.

Topology ``sharded``: every rank is the server of 1/W of the vector.

The flat gradient of d coordinates is cut into W contiguous shards (:func:`dqsgd.core.sharding.shard_bounds`);
each shard is quantized as a vector of its own (a bucket layout restarts at the shard, a per-tensor
layout keeps one scale per piece of a tensor inside it: :func:`dqsgd.core.sharding.shard_sizes`).

One step, for worker w and shard server j:

1. uplink: w quantizes shard j of g_w at the step's width B_n into its own payload (uniforms
   ``HashRNG(seed_for(seed, QUANT), n, w·W + j)`` for the fused kernel) and sends it to rank j —
   an all-to-all of payloads;
2. rank j decodes and averages its shard, Ĝ_j = (1/W) Σ_w Q(g_w)_j (or the sign majority vote);
3. downlink: rank j quantizes Ĝ_j once more — unbiased stochastic uniform rounding at ``b`` bits
   (default 8) with the max norm and the same layout, uniforms ``HashRNG(seed_for(seed, DOWNLINK),
   n, j)`` — or sends it in fp32 (``b = 32``; a sign vote is sent as signs) — and all-gathers it;
   with ``downlink_feedback`` it rounds Ĝ_j + e_j and keeps the residual e_j (``MethodState.down_residuals``,
   :meth:`~dqsgd.topology.bucket.BucketProtocol.encode_down_fed`); with a coded downlink
   (``downlink_coding``, :mod:`dqsgd.topology.downlink`) the same codes are entropy-coded;
4. every rank decodes the W shards into the same update G = [Q_d(Ĝ_0), …, Q_d(Ĝ_{W−1})]: bitwise
   identical on all ranks, so the policy, which observes G, picks the same B_{n+1} everywhere
   without another collective.

Both stages are unbiased and their randomness independent, so E[G] = (1/W) Σ_w g_w and
E‖G − ḡ‖² = (1/W²) Σ_w E‖Q(g_w) − g_w‖² + E‖Q_d(Ĝ) − Ĝ‖²: the uplink variance over W plus the
downlink's (:func:`dqsgd.theory.two_stage_variance_bound`).
Per rank and step the links carry ≈ 2·(W−1)/W·d·b/8 bytes plus headers, instead of the
(W−1)·d·b/8 of an all-gather or the (W−1)·d·(b+32)/8 of a parameter server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from dqsgd.method.pipeline import Method, MethodState
from dqsgd.quantizers import NonFiniteGradientError
from dqsgd.topology.bucket import BucketProtocol, shard_methods
from dqsgd.topology.downspec import DownlinkSpec
from dqsgd.topology.names import FP32, check_downlink_bits
from dqsgd.topology.exchange import Exchange
from dqsgd.topology.payloads import tensor_bytes
from dqsgd.topology.registry import SHARDED, wire_traffic
from dqsgd.topology.server import ServerRank, Width, settle
from dqsgd.topology.state import BucketState, Memory

if TYPE_CHECKING:
    from dqsgd.topology.links import Transport

__all__ = ["FP32", "ExchangeStep", "StepOutcome", "all_finite", "check_downlink_bits", "codec_input",
           "shard_methods", "step_for"]


@dataclass
class StepOutcome:
    """One step's exchange as one rank sees it (every topology)."""

    update: torch.Tensor              # G, the same on every rank
    up: list[list[int]]               # up[w][j]: bytes of worker w's payload for shard j (ps, allgather: one
                                      # shard); empty on a ps rank that is not the server (it sees no sizes)
    down: list[int]                   # down[j]: bytes of shard j's downlink payload (ps: the one message;
                                      # allgather: none crosses a link)
    side: int                         # per-worker side traffic (TernGrad scalers), bytes
    residuals: dict[int, torch.Tensor | None]  # new error-feedback memory of the local workers
    encode_s: float = 0.0             # seconds spent quantizing and encoding the local uplinks
    coded: dict[int, int] | None = None  # local worker -> its uplink's size with the best coding (if measured)
    coded_s: float = 0.0              # seconds spent measuring them
    topology: str = SHARDED.name     # the topology's name (dqsgd.topology.registry)
    state: MethodState | None = None  # the method state after the step: residuals and B_{n+1}

    def uplink(self) -> list[int]:
        """Bytes each worker sent (summed over its shard payloads)."""
        return [sum(row) for row in self.up]

    def wire(self) -> tuple[list[int], list[int]]:
        """Bytes per rank on the links, uplink and downlink phase (:func:`dqsgd.topology.ledger.wire_traffic`)."""
        return wire_traffic(self.topology, self.up, self.down)


def all_finite(t: Transport, grads: Mapping[int, torch.Tensor], step: int,
               on_nonfinite: str) -> bool:
    """Whether step ``step`` goes ahead: every worker's gradient is finite.

    With several processes (or ``on_nonfinite = "skip"``) one tiny max-reduce makes every rank take
    the same branch; then a non-finite gradient anywhere skips the step on every rank (``"skip"``) or
    stops every rank (``"raise"``). In one process with ``"raise"`` nothing is checked here: the
    quantizer refuses the non-finite gradient and names the worker."""
    shared = len(t.local_workers) < t.workers
    if on_nonfinite != "skip" and not shared:
        return True
    bad = torch.tensor([0.0 if bool(torch.isfinite(g).all()) else 1.0 for g in grads.values()])
    if float(t.max_reduce([bad.amax().reshape(1)])[0]) == 0.0:
        return True
    if on_nonfinite == "raise":
        raise NonFiniteGradientError(f"step {step}: a worker's gradient has NaN or Inf on some rank "
                                     f"(on_nonfinite = 'raise': every rank stops)")
    return False


def codec_input(g: torch.Tensor, method: Method) -> torch.Tensor:
    """The gradient where ``method``'s encoder takes it. The fused kernel (no error feedback) takes
    it on any device: its payload depends only on the values, and it moves to the host itself only
    what host code needs. The torch-kernel quantizers draw from CPU generators and error-feedback
    residuals live on the CPU, so those get a CPU copy."""
    if g.device.type == "cpu" or (method.fused and not method.config.error_feedback):
        return g
    return g.cpu()


def with_residuals(state: MethodState, new: Mapping[int, torch.Tensor | None]) -> list[torch.Tensor | None]:
    res = list(state.residuals)
    for w, r in new.items():
        res[w] = r
    return res


class ExchangeStep:
    """The step of ``method`` (built for the whole vector) for ``workers`` workers under ``topology``
    (any registered one): one :class:`~dqsgd.topology.exchange.Exchange` call per step."""

    def __init__(self, method: Method, param_sizes: Sequence[int], workers: int, seed: int,
                 downlink: DownlinkSpec = DownlinkSpec(), topology: str = SHARDED.name):
        self.method, self.workers, self.downlink = method, workers, downlink
        self.protocol = BucketProtocol(method.config, method.numel, param_sizes, topology=topology,
                                       workers=workers, seed=seed, total_steps=method.total_steps, method=method,
                                       spec=downlink)
        self.protocol.charge_side()  # its size tables come out of a budget, as in the DDP hook
        self.bounds, self.shards = self.protocol.bounds, self.protocol.shards
        self.policy = self.protocol.policy  # "auto": the both-leg split over the method's policy
        self.server = self.protocol.kind.server  # one rank aggregates (dqsgd.topology.server)

    def coded_size(self, row: Sequence[bytes]) -> int:
        """One worker's uplink with the best coding: Σ over its W shard payloads of their coded size."""
        return sum(m.coded_size(p) for m, p in zip(self.shards, row, strict=True))

    def run(self, t: Transport, grads: Mapping[int, torch.Tensor], state: MethodState, step: int,
            generators: Mapping[int, torch.Generator], measure_coded: bool = False) -> StepOutcome:
        """Steps 1–4 of the module docstring for the local workers ``grads`` over transport ``t``, at
        the width ``state.bits``: one :class:`~dqsgd.topology.exchange.Exchange` call over the
        transport's group (the in-process group of the simulation, or the torch.distributed one),
        whose policy observes G (the same on every rank) for B_{n+1}.

        ``measure_coded``: also give each local worker's uplink with the best coding (:meth:`coded_size`),
        measured on the payloads it sent, after the exchange (nothing sent changes)."""
        P = self.protocol
        groups = t.exchange_groups()
        b = BucketState(numel=P.numel, proto=P, step=step,
                        policy=state.policy if state.policy is not None else Width(state.bits))
        mems = {w: Memory(generator=generators[w], down_residual=state.down_residuals.get(w),
                          residuals={} if state.residuals[w] is None else
                          {j: state.residuals[w][lo:hi] for j, (lo, hi) in enumerate(P.bounds)})  # type: ignore[index]
                for w in grads}
        rank = partial(ServerRank, pick=getattr(t, "pick", None)) if self.server else None
        futures = Exchange(b, flag_nonfinite=False, rank=rank).start(
            {w: (codec_input(g, self.method).to(groups[w].device), groups[w], mems[w]) for w, g in grads.items()})
        got = settle(groups, futures)
        b.catch_up(step)  # B_{n+1}, for the next step
        first = got[next(iter(got))]
        agree = getattr(t, "agree", None)  # allgather over processes: every rank holds the same update and width
        if agree is not None:
            agree(tensor_bytes(first.update), [b.bits])
        t.steps += 1
        new_res = {w: torch.cat([m.residuals[j] for j in range(len(P.shards))]) if m.residuals else None
                   for w, m in mems.items()}
        fed = {**state.down_residuals, **{w: m.down_residual for w, m in mems.items() if m.down_residual is not None}}
        runs = not isinstance(b.policy, Width)  # this process runs the policy (ps: the server's)
        after = MethodState(b.policy if runs else None, with_residuals(state, new_res), -1 if runs else b.bits, fed)
        t1 = time.perf_counter()
        coded = {w: self.coded_size([tensor_bytes(p) for p in o.sent]) for w, o in got.items()} if measure_coded \
            else None
        return StepOutcome(first.update.cpu(), first.table, first.down, first.side, new_res,
                           sum(o.encode_s for o in got.values()), coded, time.perf_counter() - t1, P.topology, after)


def step_for(method: Method, topology: str, param_sizes: Sequence[int], workers: int, seed: int,
             downlink: DownlinkSpec = DownlinkSpec()) -> ExchangeStep:
    """The step object of ``topology`` (whose exchange its registry entry decides)."""
    return ExchangeStep(method, param_sizes, workers, seed, downlink, topology)
