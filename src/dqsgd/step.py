"""Algorithm 2 with every rank the server of 1/W of the vector (topology ``sharded``).

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
from typing import TYPE_CHECKING, Sequence

import torch

from dqsgd.codecs import Coding, encode as encode_payload, predicted_size
from dqsgd.kernels import HashRNG, encode_uniform_fast
from dqsgd.ledger import wire_traffic
from dqsgd.pipeline import Method
from dqsgd.quantizers import Norm, NonFiniteGradientError, quantize_identity
from dqsgd.sharding import DOWNLINK, shard_bounds, shard_sizes
from dqsgd.rng import QUANT, seed_for

if TYPE_CHECKING:
    from dqsgd.methods import MethodConfig
    from dqsgd.transport.base import ShardedTransport

FP32 = 32  # downlink width that means "send the averaged shard in fp32"


def check_downlink_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not (2 <= bits <= 16 or bits == FP32):
        raise ValueError(f"downlink_bits must be in [2, 16] (stochastic uniform, s = 2^(b-1) - 1) or 32 (fp32), "
                         f"got {bits!r}")
    return bits


@dataclass
class ShardedResult:
    update: torch.Tensor              # G, the same on every rank
    up: list[list[int]]               # up[w][j]: bytes of worker w's payload for shard j
    down: list[int]                   # down[j]: bytes of shard j's downlink payload
    side: int                         # per-worker side traffic (TernGrad scalers), bytes
    residuals: dict[int, torch.Tensor | None]  # new error-feedback memory of the local workers
    encode_s: float = 0.0             # seconds spent quantizing and encoding the local uplinks
    coded: dict[int, int] | None = None  # local worker -> Σ_j coded size of its W shard payloads (if measured)
    coded_s: float = 0.0              # seconds spent measuring them

    def wire(self) -> tuple[list[int], list[int]]:
        return wire_traffic("sharded", self.up, self.down)


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
    def run(self, t: ShardedTransport, grads: dict[int, torch.Tensor], bits: int, step: int,
            generators: dict[int, torch.Generator], residuals: Sequence[torch.Tensor | None],
            measure_coded: bool = False) -> ShardedResult:
        """Steps 1–4 of the module docstring for the local workers ``grads`` over transport ``t``.

        ``measure_coded``: also give each local worker's uplink with the best coding (:meth:`coded_size`),
        measured on the payloads it sent, after the exchange (nothing sent changes)."""
        scalers, side = None, 0
        if self.method.shares_scalers:
            local = [self.local_scalers(g) for g in grads.values()]
            scalers = t.max_reduce(local)
            side = 4 * scalers.numel()  # the scalers go up and come back once per worker, float32
        rows, new_res, t0 = [], {}, time.perf_counter()
        for w, g in grads.items():
            g = g if g.device.type == "cpu" else g.cpu()
            row, new_res[w] = self.encode_worker(w, g, bits, step, generators[w], residuals[w], scalers)
            rows.append(row)
        encode_s = time.perf_counter() - t0
        served, up = t.exchange(rows, [m.max_payload_bytes(bits) for m in self.shards])
        down = {}
        for j, payloads in served.items():
            avg = self.shards[j].aggregate(payloads, bits)
            down[j] = self.encode_downlink(j, avg, step)
        shared = t.share(down, max(self.down_cap(j) for j in range(self.workers)))
        # Measured once every shard server has accepted the payloads (a malformed one stopped the step above).
        t1 = time.perf_counter()
        coded = {w: self.coded_size(row) for w, row in zip(grads, rows)} if measure_coded else None
        coded_s = time.perf_counter() - t1
        return ShardedResult(self.decode_update(shared), up, [len(p) for p in shared], side, new_res, encode_s, coded,
                             coded_s)
