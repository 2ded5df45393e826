"""The exchange of sparse pseudo-gradients (methods of scheme ``topk`` / ``randk``) in Local SGD rounds.

Round r, worker w with residual e_w (error feedback; zero at the start, absent without it), value
width b and density k from the method state (fixed, or the ``sparse-budget`` policy's choice,
:mod:`dqsgd.policies.sparse_budget`):

1. p = Δ_w + e_w; S, values = the sparsifier's choice of k coordinates (:func:`dqsgd.quantizers.sparse.select`);
   their values quantized at b bits; x̂_w = the decoded message; e_w ← p − x̂_w (error feedback);
2. the messages (:mod:`dqsgd.codecs.sparse_wire`: indices, then the values) go up; the average
   Δ̂ = (1/W) Σ_w x̂_w (summed in worker order, float32) is taken where the topology aggregates;
3. Δ̂'s non-zero coordinates go down as one more sparse message: their values fp32 (``downlink_bits``
   32) or stochastically rounded at ``downlink_bits`` (uniforms of stream ``DOWNLINK`` keyed by the
   round and the shard, the same on every process); every rank applies the decoded Δ̂;
4. where a policy state is held, the policy sees Δ̂ and the bits a worker sent (the largest uplink) and
   chooses the next round's (b, k).

Topologies: ``ps`` and ``allgather`` send one message per worker over the whole vector (ps: the
server's downlink carries the largest uplink's size beside it, so every rank's policy sees the same
numbers); ``sharded`` cuts the vector into W coordinate shards (:func:`dqsgd.core.sharding.shard_bounds`):
worker w's k kept coordinates are split among the shards (one message per shard, its values scaled
on their own), rank j averages shard j and all-gathers its downlink. Every receiver refuses a message
longer than k coordinates (downlink: W·k) of its shard before allocating. The budget policy needs
every rank to hold its state: with it, ``ps`` is refused.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from dqsgd.codecs import PayloadError
from dqsgd.codecs.sparse_wire import decode_sparse, encode_sparse, sparse_message_size
from dqsgd.core.rng import DOWNLINK, generator
from dqsgd.core.sharding import shard_bounds
from dqsgd.method.pipeline import Method, MethodState
from dqsgd.policies.sparse_budget import budget_policy
from dqsgd.quantizers import Scheme, dequantize, quantize_identity
from dqsgd.quantizers.sparse import SPARSE_SCHEMES, density_count, quantize_values, select
from dqsgd.topology.downspec import DownlinkSpec
from dqsgd.topology.registry import topology_of
from dqsgd.topology.step import StepOutcome, step_for, with_residuals

if TYPE_CHECKING:
    from dqsgd.topology.links import ShardedTransport, Transport

__all__ = ["SparseStep", "local_step_for"]

SPARSE_DOWN = 0x5350  # a key part that tells the sparse downlink's rounding from the sharded topology's


class SparseStep:
    """The step of a sparse method (built for the whole vector) on ``topology`` with ``workers``."""

    rounds = 2  # the messages up, the average down

    def __init__(self, method: Method, topology: str, workers: int, seed: int, downlink_bits: int = 32):
        c, d = method.config, method.numel
        if c.scheme not in SPARSE_SCHEMES:
            raise ValueError(f"SparseStep runs the {' or '.join(SPARSE_SCHEMES)} scheme, not {c.scheme!r}")
        if not (downlink_bits == 32 or 2 <= downlink_bits <= 16):
            raise ValueError(f"method {c.name!r}: the sparse downlink's values take 2..16 bits or 32 (fp32), "
                             f"got {downlink_bits}")
        self.sharded = topology_of(topology).sharded
        if c.policy == "sparse-budget" and topology_of(topology).server:
            raise ValueError(f"method {c.name!r}: policy 'sparse-budget' runs on every rank (each chooses the next "
                             f"round's width and density from the average); topology 'ps' keeps it on the server: "
                             f"use sharded or allgather")
        self.method, self.topology, self.workers, self.seed = method, topology, workers, seed
        self.down_bits = downlink_bits
        self.bounds = shard_bounds(d, workers) if self.sharded else [(0, d)]
        self.policy = (budget_policy(c, d, method.total_steps, len(self.bounds)) if c.policy == "sparse-budget"
                       else method.policy)
        self.fixed_count = density_count(d, c.topk_ratio)

    def count(self, state: MethodState) -> int:
        """k of the next round: the budget policy's choice, else ⌈topk_ratio·d⌋."""
        return int(getattr(state.policy, "count", self.fixed_count)) if state.policy is not None else self.fixed_count

    # --- messages -------------------------------------------------------------------------------
    def up_max(self, j: int, k: int, bits: int) -> int:
        n = self.bounds[j][1] - self.bounds[j][0]
        return sparse_message_size(n, min(k, n), bits)

    def down_max(self, j: int, k: int) -> int:
        n = self.bounds[j][1] - self.bounds[j][0]
        return sparse_message_size(n, min(self.workers * k, n), self.down_bits)

    def compress(self, p: torch.Tensor, k: int, bits: int, gen: torch.Generator) -> tuple[list[bytes], torch.Tensor]:
        """One worker's messages (one per shard) of p and their decoded sum x̂ (dense)."""
        idx, values = select(p, k, self.method.config.scheme, gen)
        xhat, out = torch.zeros_like(p), []
        for lo, hi in self.bounds:
            part = (idx >= lo) & (idx < hi)
            q = quantize_values(values[part], bits, gen)
            out.append(encode_sparse(idx[part] - lo, hi - lo, q))
            xhat[idx[part]] = dequantize(q)
        return out, xhat

    def average(self, j: int, payloads: Sequence[bytes], k: int, bits: int) -> torch.Tensor:
        """Shard j's average of the W workers' messages (worker order)."""
        lo, hi = self.bounds[j]
        total = torch.zeros(hi - lo, dtype=torch.float32)
        for w, msg in enumerate(payloads):
            try:
                idx, q = decode_sparse(msg, hi - lo, k, Scheme.UNIFORM, bits)
            except PayloadError as e:
                raise PayloadError(f"worker {w}: {e}") from None
            if q is not None:
                total[idx] += dequantize(q)
        return total / self.workers

    def down_message(self, j: int, avg: torch.Tensor, step: int) -> bytes:
        idx = torch.nonzero(avg).reshape(-1)
        vals = avg[idx]
        q = quantize_identity(vals) if self.down_bits == 32 else quantize_values(
            vals, self.down_bits, generator(self.seed, DOWNLINK, SPARSE_DOWN, step, j))
        return encode_sparse(idx, avg.numel(), q)

    def down_decode(self, j: int, msg: bytes, k: int) -> torch.Tensor:
        lo, hi = self.bounds[j]
        idx, q = decode_sparse(msg, hi - lo, min(self.workers * k, hi - lo),
                               Scheme.IDENTITY if self.down_bits == 32 else Scheme.UNIFORM, self.down_bits)
        out = torch.zeros(hi - lo, dtype=torch.float32)
        if q is not None:
            out[idx] = dequantize(q)
        return out

    # --- one round ------------------------------------------------------------------------------
    def run(self, t: Transport | ShardedTransport, grads: Mapping[int, torch.Tensor], state: MethodState, step: int,
            generators: Mapping[int, torch.Generator], measure_coded: bool = False) -> StepOutcome:
        """Steps 1-4 of the module docstring for the local workers ``grads`` over ``t``."""
        ef, d = self.method.config.error_feedback, self.method.numel
        bits, k = state.bits, self.count(state)
        t0 = time.perf_counter()
        rows, new_res = {}, {}
        for w, g in grads.items():
            p = g.detach().reshape(-1).to(torch.float32).cpu()
            if p.numel() != d:
                raise ValueError(f"pseudo-gradient has {p.numel()} elements, the method was built for {d}")
            if ef and state.residuals[w] is not None:
                p = p + state.residuals[w]
            rows[w], xhat = self.compress(p, k, bits, generators[w])
            new_res[w] = p - xhat if ef else None
        encode_s = time.perf_counter() - t0
        if self.sharded:
            update, up, down, spent = self._sharded(t, rows, k, bits, step)  # type: ignore[arg-type]
        else:
            update, up, down, spent = self._server(t, rows, k, bits, step)  # type: ignore[arg-type]
        residuals = with_residuals(state, new_res)
        after = (self.method.observe(MethodState(state.policy, residuals), update, step, 8 * spent, self.policy)
                 if state.policy is not None else MethodState(None, residuals, state.bits))
        coded = {w: sum(map(len, r)) for w, r in rows.items()} if measure_coded else None
        return StepOutcome(update, up, down, 0, new_res, encode_s, coded, 0.0, self.topology, after)

    def _server(self, t: Transport, rows: dict[int, list[bytes]], k: int, bits: int,
                step: int) -> tuple[torch.Tensor, list[list[int]], list[int], int]:
        gathered = t.gather([r[0] for r in rows.values()], self.up_max(0, k, bits))
        reply, largest = None, 0
        if gathered is not None:
            reply, largest = self.down_message(0, self.average(0, gathered, k, bits), step), max(map(len, gathered))
        reply, ints = t.broadcast(reply, [largest], self.down_max(0, k))
        up = [] if gathered is None else [[len(m)] for m in gathered]
        down = [len(reply)] if topology_of(self.topology).downlink else []
        return self.down_decode(0, reply, k), up, down, int(ints[0])

    def _sharded(self, t: ShardedTransport, rows: dict[int, list[bytes]], k: int, bits: int,
                 step: int) -> tuple[torch.Tensor, list[list[int]], list[int], int]:
        served, up = t.exchange(list(rows.values()), [self.up_max(j, k, bits) for j in range(self.workers)])
        blocks = {j: self.down_message(j, self.average(j, ps, k, bits), step) for j, ps in served.items()}
        shared = t.share(blocks, max(self.down_max(j, k) for j in range(self.workers)))
        t.steps += 1
        update = torch.cat([self.down_decode(j, m, k) for j, m in enumerate(shared)])
        return update, up, [len(m) for m in shared], max(sum(r) for r in up)


def local_step_for(method: Method, topology: str, param_sizes: Sequence[int], workers: int, seed: int,
                   downlink: DownlinkSpec = DownlinkSpec()) -> object:
    """Local SGD's step object: :class:`SparseStep` for a sparse scheme (its downlink at ``downlink.bits``), else
    :func:`dqsgd.topology.step.step_for`'s."""
    if method.config.scheme in SPARSE_SCHEMES:
        if downlink.auto or downlink.feedback or downlink.coding != "fixed":
            raise ValueError(f"method {method.config.name!r}: the sparse downlink sends the average's non-zero "
                             f"coordinates at a fixed width (downlink_bits 2..16 or 32), FIXED-coded, without "
                             f"feedback; got bits {downlink.bits!r}, coding {downlink.coding!r}, feedback "
                             f"{downlink.feedback}")
        return SparseStep(method, topology, workers, seed, int(downlink.bits))
    return step_for(method, topology, param_sizes, workers, seed, downlink)
