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

Topologies, over the transport's groups (:mod:`dqsgd.topology.group`), every message's size
all-gathered first and checked against its cap (so every rank's policy sees the same numbers):
``ps`` and ``allgather`` send one message per worker over the whole vector (ps: the server's
downlink, or its refusal, is broadcast); ``sharded`` cuts the vector into W coordinate shards (:func:`dqsgd.core.sharding.shard_bounds`):
worker w's k kept coordinates are split among the shards (one message per shard, its values scaled
on their own), rank j averages shard j and sends its downlink to every rank at its own length (the lengths all-gathered
first, then one all-to-all: no padding, so the bytes counted are the bytes sent). Every receiver refuses
a message longer than k coordinates (downlink: W·k) of its shard before allocating. The budget policy needs
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
from dqsgd.topology.exchange import size_table
from dqsgd.topology.group import DOWN, UP
from dqsgd.topology.refusal import check_sizes, check_table
from dqsgd.topology.payloads import bytes_tensor, tensor_bytes
from dqsgd.topology.refusal import opened
from dqsgd.topology.registry import topology_of
from dqsgd.topology.server import SERVER, refusable, room, settle
from dqsgd.topology.step import StepOutcome, step_for, with_residuals

if TYPE_CHECKING:
    from dqsgd.topology.group import Group
    from dqsgd.topology.links import Transport

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
    def run(self, t: Transport, grads: Mapping[int, torch.Tensor], state: MethodState, step: int,
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
            update, up, down, spent = self._sharded(t, rows, k, bits, step)
        else:
            update, up, down, spent = self._server(t, rows, k, bits, step)
        residuals = with_residuals(state, new_res)
        after = (self.method.observe(MethodState(state.policy, residuals), update, step, 8 * spent, self.policy)
                 if state.policy is not None else MethodState(None, residuals, state.bits))
        coded = {w: sum(map(len, r)) for w, r in rows.items()} if measure_coded else None
        return StepOutcome(update, up, down, 0, new_res, encode_s, coded, 0.0, self.topology, after)

    def _server(self, t: Transport, rows: dict[int, list[bytes]], k: int, bits: int,
                step: int) -> tuple[torch.Tensor, list[list[int]], list[int], int]:
        """``ps`` (rank 0 averages and broadcasts the downlink, or its refusal) and ``allgather`` (every
        rank averages), over the transport's groups."""
        kind, groups = topology_of(self.topology), t.exchange_groups()
        table = self._sizes(groups, rows, [self.up_max(0, k, bits)], step)
        n = max(row[0] for row in table)
        msgs = {w: bytes_tensor(rows[w][0], length=n) for w in groups}
        got = settle(groups, {w: g.gather(msgs[w], SERVER, UP) if kind.server else g.all_gather(msgs[w], UP)
                              for w, g in groups.items()})
        received = {w: [tensor_bytes(m, row[0]) for m, row in zip(ms, table)] for w, ms in got.items() if ms is not None}
        if kind.server:
            size = self.down_max(0, k)
            out: dict[int, torch.Tensor] = {}
            for w, ps in received.items():  # the server's process: its downlink at its length, or its refusal
                out[w] = refusable(lambda: self.down_message(0, self.average(0, ps, k, bits), step), None)
            # its length broadcast first and checked against the cap, then the message as long as it is
            lengths = settle(groups, {w: g.broadcast(torch.tensor([out[w].numel() if w in out else 0]), SERVER, DOWN)
                                      for w, g in groups.items()})
            w0 = next(iter(lengths))
            n_down = int(lengths[w0][0])
            check_sizes([n_down], [room(size + 1)], f"step {step}: the sparse downlink of the server (rank {SERVER})")
            down = settle(groups, {w: g.broadcast(out.get(w, torch.zeros(n_down, dtype=torch.uint8)), SERVER, DOWN)
                                   for w, g in groups.items()})
            reply = opened(down[w0], f"rank {w0}: step {step}: the server (rank {SERVER})")
            if len(reply) > size:  # a refusal's room, but no refusal
                raise PayloadError(f"step {step}: the server's sparse downlink has {len(reply)} bytes; at most {size} fit")
        else:
            w0 = next(iter(received))
            reply = self.down_message(0, self.average(0, received[w0], k, bits), step)
        up = table if received else []
        return self.down_decode(0, reply, k), up, [len(reply)] if kind.downlink else [], n

    def _sharded(self, t: Transport, rows: dict[int, list[bytes]], k: int, bits: int,
                 step: int) -> tuple[torch.Tensor, list[list[int]], list[int], int]:
        """Rank j averages shard j of the W messages it receives and all-gathers its downlink (or its refusal)."""
        groups = t.exchange_groups()
        table = self._sizes(groups, rows, [self.up_max(j, k, bits) for j in range(self.workers)], step)
        recv = settle(groups, {w: g.all_to_all(torch.cat([bytes_tensor(m) for m in rows[w]]), table[g.rank],
                                               [row[g.rank] for row in table], UP) for w, g in groups.items()})

        def serve(w: int) -> torch.Tensor:
            j = groups[w].rank
            parts = [tensor_bytes(m) for m in recv[w].split([row[j] for row in table])]
            return refusable(lambda: self.down_message(j, self.average(j, parts, k, bits), step), None)

        # each server's downlink at its own length (its status byte last): the lengths all-gathered and checked
        # against the caps first, then one all-to-all that sends every rank the message as long as it is
        mine = {w: serve(w) for w in groups}
        sizes = settle(groups, {w: g.all_gather(torch.tensor([mine[w].numel()], dtype=torch.int64), DOWN)
                                for w, g in groups.items()})
        w0 = next(iter(sizes))
        lengths = [int(n) for n in torch.cat(sizes[w0]).tolist()]
        check_table([lengths], [room(self.down_max(j, k) + 1) for j in range(self.workers)],
                    f"step {step}: the sparse downlink, ")
        shared = settle(groups, {w: g.all_to_all(mine[w].repeat(self.workers), [mine[w].numel()] * self.workers,
                                                 lengths, DOWN) for w, g in groups.items()})
        msgs = []
        for j, m in enumerate(shared[w0].split(lengths)):
            msg = opened(m, f"rank {w0}: step {step}: rank {j} (the server of shard {j})")
            if len(msg) > self.down_max(j, k):  # a refusal's room, but no refusal: more than W·k coordinates
                raise PayloadError(f"step {step}: rank {j}'s sparse downlink has {len(msg)} bytes; "
                                   f"at most {self.down_max(j, k)} fit")
            msgs.append(msg)
        t.steps += 1
        update = torch.cat([self.down_decode(j, m, k) for j, m in enumerate(msgs)])
        return update, table, [len(m) for m in msgs], max(sum(r) for r in table)

    @staticmethod
    def _sizes(groups: Mapping[int, Group], rows: dict[int, list[bytes]], caps: list[int], step: int) -> list[list[int]]:
        """Every rank's message sizes (the exchange's :func:`size_table`), each checked against its cap
        before anything of that size is allocated."""
        got = settle(groups, {w: size_table(g, [len(m) for m in rows[w]], False, torch.device("cpu"))
                              for w, g in groups.items()})
        table = next(iter(got.values()))
        check_table(table, caps, f"step {step}: ")
        return table


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
