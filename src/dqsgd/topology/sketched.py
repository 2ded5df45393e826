"""Sketched SGD: count sketches summed across the workers, the heavy coordinates fetched exactly.

One step n, worker w with error accumulator e_w (zero at the start):

1. u_w ← ρ·u_w + g_w (momentum on the worker), a_w = e_w + u_w; the worker sends the count sketch
   S(a_w), an r × c table (a SKETCH payload);
2. the sketches are summed, S = Σ_w S(a_w) = S(Σ_w a_w) (the sketch is linear), and the m = ⌈P·k⌉
   coordinates with the largest estimates |x̃_i| of Σ_w a_w become the candidates C;
3. second round: every worker sends its exact a_w[C] (an IDENTITY payload of m values), and the sums
   V = Σ_w a_w[C] are exact;
4. the k candidates of largest |V| form T; the update is G_T = V_T / W, zero elsewhere;
5. every worker removes what was sent from its accumulator and stops its momentum there ("momentum
   masking"): e_w ← a_w and u_w ← u_w with the coordinates of T set to 0. So
   sent_w + e_w(new) = u_w + e_w(old) exactly, and Σ_w sent_w / W = G. The optimizer applies G with the
   learning rate and no momentum of its own (the method's momentum is ρ, ``sketch_momentum``).

k = max(1, round(topk_ratio·d)), c = ⌈sketch_cols·k⌉, r = sketch_rows, m = min(d, ⌈sketch_p·k⌉)
(:class:`dqsgd.method.config.MethodConfig`). The hashes come from the run's seed (stream ``SKETCH``). A worker's
memory (``MethodState.residuals[w]``, checkpointed) is the (2, d) tensor [u_w; e_w].

Topologies, each over its usual transport calls (:mod:`dqsgd.topology.links`):

* ``ps``: the server gathers the sketches, sends the candidates (an INDICES message of
  :mod:`dqsgd.codecs.sketch_wire`) with the downlink broadcast, gathers the values and broadcasts the
  sparse update (a SPARSE message: T and G_T) with B_{n+1}; a worker refuses an announced downlink
  longer than m (then k) coordinates take before it allocates (:mod:`dqsgd.topology.limits`);
* ``allgather``: every rank receives every payload and computes C, T and G itself; the broadcasts only
  check that the ranks agree (nothing crosses a link downward);
* ``sharded``: the sketch is sharded by columns — rank j sums column block j of every worker's table and
  all-gathers the sum, so every rank holds S and the same C; the values are sharded by coordinates —
  rank j sums a_w[C ∩ shard j] and all-gathers that, so every rank holds V, T and G.

The bytes the ledger records are the payloads' lengths: per worker the sketch plus the values
(sharded: over the W blocks), per downlink the candidates plus the update (sharded: the summed blocks
plus the summed values).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from dqsgd.codecs import Coding, PayloadError, encode as encode_payload, predicted_size
from dqsgd.codecs.sketch_wire import IndexKind, decode_indices, encode_indices, index_message_size
from dqsgd.core.rng import SKETCH, generator
from dqsgd.core.sharding import shard_bounds
from dqsgd.kernels import decode_accumulate, read_header
from dqsgd.method.pipeline import Method, MethodState, ProtocolError
from dqsgd.quantizers import Layout, Scheme, quantize_identity
from dqsgd.quantizers.sketch import CountSketch, sketch_message, top_indices
from dqsgd.topology.group import DOWN, UP
from dqsgd.topology.payloads import bytes_tensor, tensor_bytes
from dqsgd.topology.registry import topology_of
from dqsgd.topology.refusal import opened
from dqsgd.topology.server import phase, refusable, room
from dqsgd.topology.step import StepOutcome, with_residuals

if TYPE_CHECKING:
    from dqsgd.topology.group import Group
    from dqsgd.topology.links import Transport


class SketchedStep:
    """The step of a ``sketched-sgd`` method (built for the whole vector) on ``topology`` with ``workers``."""

    rounds = 4  # message exchanges per step: sketches up, candidates down, values up, update down

    def __init__(self, method: Method, seed: int, topology: str, workers: int):
        if method.config.scheme != "sketch":
            raise ValueError(f"SketchedStep runs the sketch scheme, not {method.config.scheme!r}")
        c, d = method.config, method.numel
        self.method, self.topology, self.workers = method, topology, workers
        self.policy = method.policy  # a fixed width
        self.k = min(d, max(1, round(c.topk_ratio * d)))
        self.cols = max(1, math.ceil(c.sketch_cols * self.k))
        self.m = min(d, math.ceil(c.sketch_p * self.k))
        self.rho = c.sketch_momentum
        self.cs = CountSketch.draw(d, c.sketch_rows, self.cols, generator(seed, SKETCH))
        if topology_of(topology).sharded:
            if self.cols < workers:
                raise ValueError(f"topology sharded cuts the sketch's {self.cols} columns among {workers} workers: "
                                 f"raise sketch_cols or topk_ratio")
            self.col_bounds, self.coord_bounds = shard_bounds(self.cols, workers), shard_bounds(d, workers)

    # --- sizes ----------------------------------------------------------------------------------
    def sketch_bytes(self, cols: int | None = None) -> int:
        """The exact size of a sketch payload of ``cols`` columns (default: the whole table)."""
        return predicted_size(self.cs.rows * (self.cols if cols is None else cols), 32, 0, 2, Layout())

    @staticmethod
    def values_bytes(n: int) -> int:
        return predicted_size(n, 32, 0, 1, Layout(), Coding.FIXED)

    # --- pieces ---------------------------------------------------------------------------------
    def accumulate(self, grad: torch.Tensor, memory: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(u_w, a_w): the momentum u_w = ρ·u_w + g_w and the accumulator a_w = e_w + u_w (float32, CPU).
        ``memory`` is the worker's (2, d) state [u_w; e_w] (None: zeros)."""
        g = grad.detach().reshape(-1).to(torch.float32).cpu()
        if g.numel() != self.method.numel:
            raise ValueError(f"gradient has {g.numel()} elements, the method was built for {self.method.numel}")
        if not bool(torch.isfinite(g).all()):
            from dqsgd.quantizers import NonFiniteGradientError

            raise NonFiniteGradientError("sketched-sgd: the gradient has NaN or Inf values")
        if memory is None:
            return g, g
        u = self.rho * memory[0] + g if self.rho else g
        return u, memory[1] + u

    def sum_payloads(self, payloads: Sequence[bytes], scheme: Scheme, shape: tuple[int, ...]) -> torch.Tensor:
        """Σ_w of the payloads' values (worker order), each checked to be ``scheme`` of ``shape``."""
        total = torch.zeros(math.prod(shape), dtype=torch.float32)
        for w, p in enumerate(payloads):
            try:
                h = read_header(p, numel=total.numel())
                if h.scheme != scheme or tuple(h.shape) != shape:
                    raise ProtocolError(f"worker {w}: expected a {scheme.name} message of shape {shape}, got "
                                        f"{h.scheme.name} of shape {tuple(h.shape)}")
                decode_accumulate(p, total, header=h)
            except PayloadError as e:
                raise PayloadError(f"worker {w}: {e}") from None
        return total.reshape(shape)

    def candidates(self, table: torch.Tensor) -> torch.Tensor:
        """C: the m coordinates of largest estimate in the summed sketch, increasing."""
        return top_indices(self.cs.estimate(table), self.m)

    def choose(self, cand: torch.Tensor, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, G_T): the k candidates of largest exact |sum|, and their mean over the W workers."""
        pick = top_indices(sums, self.k)
        return cand[pick], sums[pick] / self.workers

    def update_of(self, chosen: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        update = torch.zeros(self.method.numel, dtype=torch.float32)
        update[chosen] = values
        return update

    @staticmethod
    def memory_after(u: torch.Tensor, acc: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """[u_w; e_w] after the step: the momentum and the accumulator without the coordinates sent."""
        mem = torch.stack([u, acc])
        mem[:, chosen] = 0.0
        return mem

    # --- one step -------------------------------------------------------------------------------
    def run(self, t: Transport, grads: Mapping[int, torch.Tensor], state: MethodState, step: int,
            generators: Mapping[int, torch.Generator], measure_coded: bool = False) -> StepOutcome:
        """Steps 1-5 of the module docstring for the local workers ``grads`` over the transport's
        groups (:meth:`~dqsgd.topology.links.Transport.exchange_groups`); then the policy (fixed
        width) observes G. ``measure_coded``: fp32 payloads count their own length."""
        t0 = time.perf_counter()
        mom_acc = {w: self.accumulate(g, state.residuals[w]) for w, g in grads.items()}
        acc = {w: a for w, (_, a) in mom_acc.items()}
        tables = {w: self.cs.sketch(a) for w, a in acc.items()}
        encode_s = time.perf_counter() - t0
        groups = t.exchange_groups()
        run = self._sharded if topology_of(self.topology).sharded else self._server
        chosen, values, up, down, sent = run(groups, acc, tables, step)
        new_res = {w: self.memory_after(u, a, chosen) for w, (u, a) in mom_acc.items()}
        update = self.update_of(chosen, values)
        agree = getattr(t, "agree", None)  # allgather over processes: every rank holds the same update
        if agree is not None:
            agree(encode_indices(chosen, self.method.numel, values), [state.bits])
        t.steps += 1  # two rounds, one completed step
        residuals = with_residuals(state, new_res)
        if state.policy is not None:
            after = self.method.observe(MethodState(state.policy, residuals), update, step,
                                        8 * max((sum(r) for r in up), default=0))
        else:
            after = MethodState(None, residuals, state.bits)
        coded = {w: sent[w] for w in grads} if measure_coded else None
        return StepOutcome(update, up, down, 0, new_res, encode_s, coded, 0.0, self.topology, after)

    def _server(self, groups: Mapping[int, Group], acc: dict[int, torch.Tensor], tables: dict[int, torch.Tensor],
                step: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], list[int], dict[int, int]]:
        """``ps`` (rank 0 aggregates and broadcasts C, then T and G_T) and ``allgather`` (every rank does)."""
        d, shape, kind = self.method.numel, (self.cs.rows, self.cols), topology_of(self.topology)
        sketches = {w: encode_payload(sketch_message(tables[w])) for w in acc}

        def collect(payloads: Mapping[int, bytes]) -> dict[int, list[bytes] | None]:
            got = phase(groups, lambda w, g: g.gather(bytes_tensor(payloads[w]), 0, UP) if kind.server
                        else g.all_gather(bytes_tensor(payloads[w]), UP))
            return {w: None if ms is None else [tensor_bytes(m) for m in ms] for w, ms in got.items()}

        def answer(what: dict[int, Any], size: int) -> bytes:
            """Every rank's copy of the aggregator's message (ps: broadcast by rank 0, with its refusal)."""
            if not kind.server:
                return next(iter(what.values()))()
            n = room(size + 1)
            msgs = {w: refusable(what[w], n) if groups[w].rank == 0 else torch.zeros(n, dtype=torch.uint8) for w in groups}
            got = phase(groups, lambda w, g: g.broadcast(msgs[w], 0, DOWN))
            return {w: opened(m, f"rank {w}: step {step}: the server (rank 0)")[:size]
                    for w, m in got.items()}[next(iter(got))]

        gathered = collect(sketches)
        ask = answer({w: lambda ps=ps: encode_indices(self.candidates(self.sum_payloads(ps, Scheme.SKETCH, shape)), d)
                      for w, ps in gathered.items()}, index_message_size(d, self.m, IndexKind.INDICES))
        cand, _ = decode_indices(ask, d, self.m, IndexKind.INDICES)
        values = {w: encode_payload(quantize_identity(acc[w][cand])) for w in acc}
        answers = collect(values)

        def reply_of(ps: list[bytes]) -> bytes:
            chosen, vals = self.choose(cand, self.sum_payloads(ps, Scheme.IDENTITY, (cand.numel(),)))
            return encode_indices(chosen, d, vals)

        reply = answer({w: lambda ps=ps: reply_of(ps) for w, ps in answers.items()},
                       index_message_size(d, self.k, IndexKind.SPARSE))
        chosen, vals = decode_indices(reply, d, self.k, IndexKind.SPARSE)
        sent = {w: len(sketches[w]) + len(values[w]) for w in acc}
        up = [[self.sketch_bytes() + self.values_bytes(cand.numel())] for _ in range(self.workers)]
        down = [len(ask) + len(reply)] if kind.downlink else []
        assert vals is not None
        return chosen, vals, up, down, sent

    def _sharded(self, groups: Mapping[int, Group], acc: dict[int, torch.Tensor], tables: dict[int, torch.Tensor],
                 step: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], list[int], dict[int, int]]:
        """Rank j sums column block j of the sketches, then coordinate shard j of the candidates' values."""
        rows = {w: [encode_payload(sketch_message(tables[w][:, lo:hi].contiguous())) for lo, hi in self.col_bounds]
                for w in acc}
        blocks = [self.sketch_bytes(hi - lo) for lo, hi in self.col_bounds]
        shared = self._round(groups, rows, blocks, Scheme.SKETCH, self._block_shape, step)
        table = torch.cat([self.sum_payloads([p], Scheme.SKETCH, self._block_shape(j)) for j, p in enumerate(shared)],
                          dim=1)
        cand = self.candidates(table)
        parts = [cand[(cand >= lo) & (cand < hi)] for lo, hi in self.coord_bounds]
        rows2 = {w: [encode_payload(quantize_identity(acc[w][part])) for part in parts] for w in acc}
        sizes2 = [self.values_bytes(part.numel()) for part in parts]
        shared2 = self._round(groups, rows2, sizes2, Scheme.IDENTITY, lambda j: (parts[j].numel(),), step)
        exact = torch.cat([self.sum_payloads([p], Scheme.IDENTITY, (parts[j].numel(),)) for j, p in enumerate(shared2)])
        chosen, vals = self.choose(cand, exact)
        up = [[a + b for a, b in zip(blocks, sizes2)] for _ in range(self.workers)]
        down = [len(a) + len(b) for a, b in zip(shared, shared2)]
        sent = {w: sum(map(len, rows[w])) + sum(map(len, rows2[w])) for w in acc}
        return chosen, vals, up, down, sent

    def _round(self, groups: Mapping[int, Group], rows: Mapping[int, list[bytes]], sizes: list[int], scheme: Scheme,
               shape: Callable[[int], tuple[int, ...]], step: int) -> list[bytes]:
        """One sharded round: an all-to-all of every rank's W payloads (``sizes[j]`` bytes for rank j), rank
        j sums its W, and the W sums are all-gathered (each followed by its server's status byte)."""
        got = phase(groups, lambda w, g: g.all_to_all(bytes_tensor(b"".join(rows[w])), sizes,
                                                      [sizes[g.rank]] * g.size, UP))

        def serve(w: int) -> bytes:
            j = groups[w].rank
            total = self.sum_payloads([tensor_bytes(p) for p in got[w].split(sizes[j])], scheme, shape(j))
            return encode_payload(quantize_identity(total) if scheme == Scheme.IDENTITY else sketch_message(total))

        sums = {w: refusable(lambda w=w: serve(w), room(max(sizes) + 1)) for w in groups}
        gathered = phase(groups, lambda w, g: g.all_gather(sums[w], DOWN))
        first = next(iter(gathered))
        return [opened(m, f"rank {first}: step {step}: rank {j} (the server of shard {j})")[: sizes[j]]
                for j, m in enumerate(gathered[first])]

    def _block_shape(self, j: int) -> tuple[int, int]:
        lo, hi = self.col_bounds[j]
        return (self.cs.rows, hi - lo)
