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

Each worker's part of a step is a :class:`SketchRank`: a chain of futures over its group
(:mod:`dqsgd.topology.group`), every collective issued from the completion of the one before, so the
simulation's W in-process ranks and one ``torch.distributed`` rank run the same code. Topologies:

* ``ps``: the server gathers the sketches, sends the candidates (an INDICES message of
  :mod:`dqsgd.codecs.sketch_wire`) with the downlink broadcast, gathers the values and broadcasts the
  sparse update (a SPARSE message: T and G_T) with B_{n+1}; a worker refuses an announced downlink
  longer than m (then k) coordinates take before it allocates (:mod:`dqsgd.topology.refusal`);
* ``allgather``: every rank receives every payload and computes C, T and G itself (over processes
  the transport's ``agree`` checks that the ranks hold the same update; nothing crosses a link downward);
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
from dqsgd.topology.group import DOWN, UP, after, release, then
from dqsgd.topology.payloads import bytes_tensor, tensor_bytes
from dqsgd.topology.registry import topology_of
from dqsgd.topology.refusal import opened
from dqsgd.topology.server import refusable, releasing, room, settle
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
        """Steps 1-5 of the module docstring for the local workers ``grads``: one :class:`SketchRank`
        per worker over the transport's groups (:meth:`~dqsgd.topology.links.Transport.exchange_groups`),
        waited for together; then the policy (fixed width) observes G. ``measure_coded``: fp32 payloads
        count their own length."""
        t0 = time.perf_counter()
        mom_acc = {w: self.accumulate(g, state.residuals[w]) for w, g in grads.items()}
        tables = {w: self.cs.sketch(a) for w, (_, a) in mom_acc.items()}
        encode_s = time.perf_counter() - t0
        groups = t.exchange_groups()
        got = settle(groups, {w: SketchRank(self, w, groups[w], a, tables[w], step).start()
                              for w, (_, a) in mom_acc.items()})
        chosen, values, up, down = got[next(iter(got))].result
        new_res = {w: self.memory_after(u, a, chosen) for w, (u, a) in mom_acc.items()}
        update = self.update_of(chosen, values)
        agree = getattr(t, "agree", None)  # allgather over processes: every rank holds the same update
        if agree is not None:
            agree(encode_indices(chosen, self.method.numel, values), [state.bits])
        t.steps += 1  # two rounds, one completed step
        residuals = with_residuals(state, new_res)
        if state.policy is not None:
            after_ = self.method.observe(MethodState(state.policy, residuals), update, step,
                                         8 * max((sum(r) for r in up), default=0))
        else:
            after_ = MethodState(None, residuals, state.bits)
        coded = {w: got[w].sent for w in grads} if measure_coded else None
        return StepOutcome(update, up, down, 0, new_res, encode_s, coded, 0.0, self.topology, after_)

    def block_shape(self, j: int) -> tuple[int, int]:
        """The shape of column block j of the sketch (``sharded``)."""
        lo, hi = self.col_bounds[j]
        return (self.cs.rows, hi - lo)


class SketchRank:
    """One worker's part of one step of ``s`` (rank ``rank``, its accumulator ``acc`` and sketch
    ``table``) over its group, as a chain of futures: :meth:`start` issues the first collective and
    every later one is issued from a completion callback, so W ranks of one in-process group and one
    rank of a ``torch.distributed`` group run the same code. Its turns on both legs
    (:class:`~dqsgd.topology.group.Turns`) are held until its last collective on each (the values'
    uplink follows the candidates' downlink)."""

    def __init__(self, s: SketchedStep, rank: int, group: Group, acc: torch.Tensor, table: torch.Tensor, step: int):
        self.s, self.r, self.g, self.acc, self.table, self.step = s, rank, group, acc, table, step
        self.kind, self.d = topology_of(s.topology), s.method.numel
        self.sent = 0  # bytes of this rank's payloads
        self.result: tuple[torch.Tensor, torch.Tensor, list[list[int]], list[int]] | None = None

    def start(self) -> torch.futures.Future:
        (up, self.up_mine), (self.down_prev, self.down_mine) = self.g.turns.turn(UP), self.g.turns.turn(DOWN)
        f = then(then(up, self._sharded if self.kind.sharded else self._server), self._keep)
        return releasing(f, self.up_mine, self.down_mine)

    def _keep(self, result: tuple[torch.Tensor, torch.Tensor, list[list[int]], list[int]]) -> SketchRank:
        """(T, G_T, the uplink's bytes per worker, the downlink's) kept; the rank's future holds itself."""
        self.result = result
        return self

    # --- ps and allgather ------------------------------------------------------------------------
    def _server(self, _: Any) -> torch.futures.Future:
        """Sketches up, C down, values up, T and G_T down (ps: rank 0 aggregates; allgather: every rank)."""
        s, shape = self.s, (self.s.cs.rows, self.s.cols)
        ask_size, reply_size = (index_message_size(self.d, n, k) for n, k in
                                ((s.m, IndexKind.INDICES), (s.k, IndexKind.SPARSE)))

        def ask_of(ps: list[bytes]) -> bytes:
            return encode_indices(s.candidates(s.sum_payloads(ps, Scheme.SKETCH, shape)), self.d)

        f = self._collect(encode_payload(sketch_message(self.table)), False)
        f = then(after(f, self.down_prev), lambda ps: self._answer(lambda: ask_of(ps), ask_size, False))

        def values(ask: bytes) -> torch.futures.Future:
            cand, _ = decode_indices(ask, self.d, s.m, IndexKind.INDICES)

            def reply_of(ps: list[bytes]) -> bytes:
                chosen, vals = s.choose(cand, s.sum_payloads(ps, Scheme.IDENTITY, (cand.numel(),)))
                return encode_indices(chosen, self.d, vals)

            f = self._collect(encode_payload(quantize_identity(self.acc[cand])), True)
            f = then(f, lambda ps: self._answer(lambda: reply_of(ps), reply_size, True))
            return then(f, lambda reply: self._served(cand, ask, reply))

        return then(f, values)

    def _collect(self, payload: bytes, last: bool) -> torch.futures.Future:
        """Every rank's payload on the server (ps; None elsewhere) or on every rank (allgather)."""
        self.sent += len(payload)
        t = bytes_tensor(payload)
        fut = self.g.gather(t, 0, UP) if self.kind.server else self.g.all_gather(t, UP)
        if last:
            release(self.up_mine)
        return then(fut, lambda ms: None if ms is None else [tensor_bytes(m) for m in ms])

    def _answer(self, make: Callable[[], bytes], size: int, last: bool) -> Any:
        """The aggregator's message on every rank: ps, rank 0's ``make()`` broadcast (or its refusal,
        raised on every rank); allgather, each rank's own ``make()`` (the same bytes)."""
        if not self.kind.server:
            return make()
        n = room(size + 1)
        msg = refusable(make, n) if self.g.rank == 0 else torch.zeros(n, dtype=torch.uint8)
        fut = self.g.broadcast(msg, 0, DOWN)
        if last:
            release(self.down_mine)
        return then(fut, lambda m: opened(m, f"rank {self.r}: step {self.step}: the server (rank 0)")[:size])

    def _served(self, cand: torch.Tensor, ask: bytes, reply: bytes) -> tuple:
        """(T, G_T) from the server's reply, and the step's bytes up (per worker) and down."""
        s = self.s
        chosen, vals = decode_indices(reply, self.d, s.k, IndexKind.SPARSE)
        assert vals is not None
        up = [[s.sketch_bytes() + s.values_bytes(cand.numel())] for _ in range(s.workers)]
        return chosen, vals, up, [len(ask) + len(reply)] if self.kind.downlink else []

    # --- sharded ---------------------------------------------------------------------------------
    def _sharded(self, _: Any) -> torch.futures.Future:
        """Rank j sums column block j of the sketches, then coordinate shard j of the candidates' values."""
        s = self.s
        rows = [encode_payload(sketch_message(self.table[:, lo:hi].contiguous())) for lo, hi in s.col_bounds]
        blocks = [s.sketch_bytes(hi - lo) for lo, hi in s.col_bounds]

        def values(shared: list[bytes]) -> torch.futures.Future:
            table = torch.cat([s.sum_payloads([p], Scheme.SKETCH, s.block_shape(j)) for j, p in enumerate(shared)],
                              dim=1)
            cand = s.candidates(table)
            parts = [cand[(cand >= lo) & (cand < hi)] for lo, hi in s.coord_bounds]
            rows2 = [encode_payload(quantize_identity(self.acc[part])) for part in parts]
            sizes2 = [s.values_bytes(part.numel()) for part in parts]

            def chosen(shared2: list[bytes]) -> tuple:
                exact = torch.cat([s.sum_payloads([p], Scheme.IDENTITY, (parts[j].numel(),))
                                   for j, p in enumerate(shared2)])
                up = [[a + b for a, b in zip(blocks, sizes2)] for _ in range(s.workers)]
                return (*s.choose(cand, exact), up, [len(a) + len(b) for a, b in zip(shared, shared2)])

            return then(self._round(rows2, sizes2, Scheme.IDENTITY, lambda j: (parts[j].numel(),), True), chosen)

        return then(self._round(rows, blocks, Scheme.SKETCH, s.block_shape, False), values)

    def _round(self, rows: list[bytes], sizes: list[int], scheme: Scheme, shape: Callable[[int], tuple[int, ...]],
               last: bool) -> torch.futures.Future:
        """One sharded round: an all-to-all of this rank's W payloads (``sizes[j]`` bytes for rank j),
        rank j sums its W, and the W sums are all-gathered (each followed by its server's status byte)."""
        s, j, W = self.s, self.g.rank, self.g.size
        self.sent += sum(map(len, rows))
        fut = self.g.all_to_all(bytes_tensor(b"".join(rows)), sizes, [sizes[j]] * W, UP)
        if last:
            release(self.up_mine)

        def serve(recv: torch.Tensor) -> torch.futures.Future:
            def total() -> bytes:
                got = s.sum_payloads([tensor_bytes(p) for p in recv.split(sizes[j])], scheme, shape(j))
                return encode_payload(quantize_identity(got) if scheme == Scheme.IDENTITY else sketch_message(got))

            out = self.g.all_gather(refusable(total, room(max(sizes) + 1)), DOWN)
            if last:
                release(self.down_mine)
            return then(out, lambda msgs: [opened(m, f"rank {self.r}: step {self.step}: rank {i} (the server of "
                                                     f"shard {i})")[: sizes[i]] for i, m in enumerate(msgs)])

        return then(after(fut, self.down_prev), serve)  # the previous step's downlink issued first
