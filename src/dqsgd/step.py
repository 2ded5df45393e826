"""One step of DQSGD Algorithm 2 for every topology: the exchange from local gradients to the update.

The trainer calls one step object per run, ``run(transport, grads, state, step, generators)``, and
gets an :class:`Exchange`: the update every rank applies, the bytes that crossed the wire, the
method state after the step (error-feedback memory, the policy's B_{n+1}) and timings. Two classes:

* :class:`ServerStep` — topologies ``ps`` and ``allgather``: every worker encodes its whole
  gradient, the aggregating process(es) decode and average the W payloads into G, the policy picks
  B_{n+1} from G, the server encodes the downlink (fp32, or the signs of a majority vote) and sends
  it together with B_{n+1} to every process, which decodes it into the update. With ``allgather``
  every rank aggregates the same bytes and runs the same policy; the transport checks that they agree.
* :class:`ShardedStep` — topology ``sharded``, below.

:func:`all_finite` is the step's check of the gradients before anything is encoded.

Topology ``sharded``: every rank is the server of 1/W of the vector.

The flat gradient of d coordinates is cut into W contiguous shards (:func:`dqsgd.sharding.shard_bounds`);
each shard is quantized as a vector of its own (a bucket layout restarts at the shard, a per-tensor
layout keeps one scale per piece of a tensor inside it: :func:`dqsgd.sharding.shard_sizes`).

One step, for worker w and shard server j:

1. uplink: w quantizes shard j of g_w at the step's width B_n into its own payload (uniforms
   ``HashRNG(seed_for(seed, QUANT), n, w·W + j)`` for the fused kernel) and sends it to rank j —
   an all-to-all of payloads;
2. rank j decodes and averages its shard, Ĝ_j = (1/W) Σ_w Q(g_w)_j (or the sign majority vote);
3. downlink: rank j quantizes Ĝ_j once more — unbiased stochastic uniform rounding at ``b`` bits
   (default 8) with the max norm and the same layout, uniforms ``HashRNG(seed_for(seed, DOWNLINK),
   n, j)`` — or sends it in fp32 (``b = 32``; a sign vote is sent as signs) — and all-gathers it;
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
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from dqsgd.codecs import Coding, encode as encode_payload, predicted_size
from dqsgd.kernels import HashRNG, encode_uniform_fast
from dqsgd.ledger import wire_traffic
from dqsgd.pipeline import Method, MethodState
from dqsgd.quantizers import Norm, NonFiniteGradientError, quantize_identity
from dqsgd.sharding import DOWNLINK, shard_bounds, shard_sizes
from dqsgd.rng import QUANT, seed_for

if TYPE_CHECKING:
    from dqsgd.methods import MethodConfig
    from dqsgd.transport.base import ShardedTransport, Transport

FP32 = 32  # downlink width that means "send the averaged shard in fp32"


def check_downlink_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not (2 <= bits <= 16 or bits == FP32):
        raise ValueError(f"downlink_bits must be in [2, 16] (stochastic uniform, s = 2^(b-1) - 1) or 32 (fp32), "
                         f"got {bits!r}")
    return bits


@dataclass
class Exchange:
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
    topology: str = "sharded"
    state: MethodState | None = None  # the method state after the step: residuals and B_{n+1}

    def uplink(self) -> list[int]:
        """Bytes each worker sent (summed over its shard payloads)."""
        return [sum(row) for row in self.up]

    def wire(self) -> tuple[list[int], list[int]]:
        """Bytes per rank on the links, uplink and downlink phase (:func:`dqsgd.ledger.wire_traffic`)."""
        return wire_traffic(self.topology, self.up, self.down)


ShardedResult = Exchange  # the earlier name of the sharded step's result


def all_finite(t: Transport | ShardedTransport, grads: Mapping[int, torch.Tensor], step: int,
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


def _with_residuals(state: MethodState, new: Mapping[int, torch.Tensor | None]) -> list[torch.Tensor | None]:
    res = list(state.residuals)
    for w, r in new.items():
        res[w] = r
    return res


class ServerStep:
    """Topologies ``ps`` and ``allgather``: the whole vector, one aggregation, one downlink."""

    def __init__(self, method: Method, seed: int, topology: str = "ps"):
        if topology not in ("ps", "allgather"):
            raise ValueError(f"ServerStep runs topology 'ps' or 'allgather', not {topology!r}")
        self.method, self.topology = method, topology
        self.quant_seed = seed_for(seed, QUANT)

    def encode_worker(self, worker: int, grad: torch.Tensor, bits: int, step: int, generator: torch.Generator | None,
                      residual: torch.Tensor | None, scalers: torch.Tensor | None) -> tuple[bytes, torch.Tensor | None]:
        """Worker ``worker``'s uplink payload at width ``bits`` and its new error-feedback memory."""
        m = self.method
        key = HashRNG(self.quant_seed, step, worker) if m.fused else None
        try:
            return m.encode(codec_input(grad, m), bits, generator, residual, scalers, hash_rng=key)
        except NonFiniteGradientError as e:
            raise NonFiniteGradientError(f"step {step}, worker {worker}: {e}") from None

    def run(self, t: Transport, grads: Mapping[int, torch.Tensor], state: MethodState, step: int,
            generators: Mapping[int, torch.Generator], measure_coded: bool = False) -> Exchange:
        """One step for the local workers ``grads`` over ``t``, at the width ``state.bits``.

        The aggregating process runs the policy on G before the downlink leaves, and B_{n+1} travels
        with the downlink payload (one integer beside it): a ps rank other than the server gets a
        state holding only that width; with allgather every rank computed it and the transport checks
        that all agree. ``measure_coded``: also give each local worker's uplink with the best coding,
        measured after the downlink (every payload was accepted by then)."""
        m, bits = self.method, state.bits
        scalers, side = None, 0
        if m.shares_scalers:
            scalers = t.max_reduce([m.local_scalers(g) for g in grads.values()])
            side = 4 * scalers.numel()  # L float32 scalers up and down per worker [docs/algorithms.md §3]
        t0, payloads, new_res = time.perf_counter(), [], {}
        for w, g in grads.items():
            msg, new_res[w] = self.encode_worker(w, g, bits, step, generators[w], state.residuals[w], scalers)
            payloads.append(msg)
        encode_s = time.perf_counter() - t0
        residuals = _with_residuals(state, new_res)
        gathered = t.gather(payloads, m.max_payload_bytes(bits))
        down, up, after = None, [], None
        if t.is_server and gathered is not None:
            agg = m.aggregate(gathered, bits)
            down = m.encode_downlink(agg)
            up = [[len(p)] for p in gathered]
            after = m.observe(MethodState(state.policy, residuals), agg, step, 8 * max(len(p) for p in gathered))
        down, (next_bits,) = t.broadcast(down, [bits if after is None else after.bits])
        if after is None:
            after = MethodState(None, residuals, next_bits)
        update = m.decode_downlink(down)
        t1 = time.perf_counter()
        coded = {w: m.coded_size(p) for w, p in zip(grads, payloads)} if measure_coded else None
        return Exchange(update, up, [] if self.topology == "allgather" else [len(down)], side, new_res, encode_s,
                        coded, time.perf_counter() - t1, self.topology, after)


def shard_methods(config: MethodConfig, numel: int, total_steps: int, param_sizes: Sequence[int],
                  workers: int) -> tuple[list[tuple[int, int]], list[Method]]:
    """The ``workers`` contiguous shards of a vector of ``numel`` coordinates and the method each is
    quantized with: a shard is a vector of its own (a bucket layout restarts at its start, a
    per-tensor layout is cut at its edges). The trainer's sharded step and the DDP hook share it."""
    bounds = shard_bounds(numel, workers)
    return bounds, [Method(config, hi - lo, total_steps, shard_sizes(param_sizes, lo, hi)) for lo, hi in bounds]


class ShardedStep:
    """The sharded step of ``method`` (built for the whole vector) for ``workers`` shards."""

    def __init__(self, method: Method, param_sizes: Sequence[int], workers: int, seed: int, downlink_bits: int = 8):
        if method.numel < workers:
            raise ValueError(f"topology sharded needs at least one coordinate per shard: {method.numel} "
                             f"coordinates for {workers} workers")
        self.method, self.workers = method, workers
        self.downlink_bits = check_downlink_bits(downlink_bits)
        self.bounds, self.shards = shard_methods(method.config, method.numel, method.total_steps, param_sizes,
                                                 workers)
        self.quant_seed, self.down_seed = seed_for(seed, QUANT), seed_for(seed, DOWNLINK)

    # --- worker side ----------------------------------------------------------------------------
    def local_scalers(self, grad: torch.Tensor) -> torch.Tensor:
        """TernGrad: the scalers of every shard's segments, concatenated (max-reduced as one tensor)."""
        return torch.cat([m.local_scalers(grad[lo:hi]) for m, (lo, hi) in zip(self.shards, self.bounds)])

    def _split_scalers(self, scalers: torch.Tensor | None) -> list[torch.Tensor | None]:
        if scalers is None:
            return [None] * self.workers
        counts = [m.layout.num_segments(m.numel) for m in self.shards]
        return list(torch.split(scalers, counts))

    def coded_size(self, row: Sequence[bytes]) -> int:
        """One worker's uplink with the best coding: Σ over its W shard payloads of their coded size."""
        return sum(m.coded_size(p) for m, p in zip(self.shards, row, strict=True))

    def encode_worker(self, worker: int, grad: torch.Tensor, bits: int, step: int, generator: torch.Generator | None,
                      residual: torch.Tensor | None, scalers: torch.Tensor | None) -> tuple[list[bytes], torch.Tensor | None]:
        """Worker ``worker``'s W shard payloads, and its new error-feedback memory (whole vector)."""
        row, res = [], []
        for j, (m, (lo, hi), sc) in enumerate(zip(self.shards, self.bounds, self._split_scalers(scalers))):
            key = HashRNG(self.quant_seed, step, worker * self.workers + j) if m.fused else None
            r_j = None if residual is None else residual[lo:hi]
            try:
                msg, r = m.encode(grad[lo:hi], bits, generator, r_j, sc, hash_rng=key)
            except NonFiniteGradientError as e:
                raise NonFiniteGradientError(f"step {step}, worker {worker}, shard {j}: {e}") from None
            row.append(msg)
            res.append(r)
        return row, (None if res[0] is None else torch.cat(res))

    # --- shard server side ----------------------------------------------------------------------
    def encode_downlink(self, shard: int, avg: torch.Tensor, step: int) -> bytes:
        m = self.shards[shard]
        if m.config.downlink == "sign":  # a majority vote: its signs are the update
            return m.encode_downlink(avg)
        if self.downlink_bits == FP32:
            return encode_payload(quantize_identity(avg), Coding.FIXED)
        return encode_uniform_fast(avg, self.downlink_bits, HashRNG(self.down_seed, step, shard), norm=Norm.MAX,
                                   layout=m.layout, coding=Coding.FIXED)

    def down_cap(self, shard: int) -> int:
        """An upper bound of shard ``shard``'s downlink payload: fp32 values plus every segment's scale."""
        m = self.shards[shard]
        return predicted_size(m.numel, 32, m.layout.num_segments(m.numel), 1, m.layout, Coding.FIXED)

    def decode_update(self, payloads: Sequence[bytes]) -> torch.Tensor:
        return torch.cat([m.decode_downlink(p) for m, p in zip(self.shards, payloads)])

    # --- one step -------------------------------------------------------------------------------
    def run(self, t: ShardedTransport, grads: Mapping[int, torch.Tensor], state: MethodState, step: int,
            generators: Mapping[int, torch.Generator], measure_coded: bool = False) -> Exchange:
        """Steps 1–4 of the module docstring for the local workers ``grads`` over transport ``t``, at
        the width ``state.bits``; then the policy observes G (the same on every rank) for B_{n+1}.

        ``measure_coded``: also give each local worker's uplink with the best coding (:meth:`coded_size`),
        measured on the payloads it sent, after the exchange (nothing sent changes)."""
        bits = state.bits
        scalers, side = None, 0
        if self.method.shares_scalers:
            local = [self.local_scalers(g) for g in grads.values()]
            scalers = t.max_reduce(local)
            side = 4 * scalers.numel()  # the scalers go up and come back once per worker, float32
        rows, new_res, t0 = [], {}, time.perf_counter()
        for w, g in grads.items():
            g = g if g.device.type == "cpu" else g.cpu()
            row, new_res[w] = self.encode_worker(w, g, bits, step, generators[w], state.residuals[w], scalers)
            rows.append(row)
        encode_s = time.perf_counter() - t0
        served, up = t.exchange(rows, [m.max_payload_bytes(bits) for m in self.shards])
        down = {}
        for j, payloads in served.items():
            avg = self.shards[j].aggregate(payloads, bits)
            down[j] = self.encode_downlink(j, avg, step)
        shared = t.share(down, max(self.down_cap(j) for j in range(self.workers)))
        update = self.decode_update(shared)
        after = self.method.observe(MethodState(state.policy, _with_residuals(state, new_res)), update, step,
                                    8 * max(sum(row) for row in up))
        # Measured once every shard server has accepted the payloads (a malformed one stopped the step above).
        t1 = time.perf_counter()
        coded = {w: self.coded_size(row) for w, row in zip(grads, rows)} if measure_coded else None
        coded_s = time.perf_counter() - t1
        return Exchange(update, up, [len(p) for p in shared], side, new_res, encode_s, coded, coded_s, "sharded", after)
