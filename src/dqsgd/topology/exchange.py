"""One bucket's exchange, written once: what every rank does with its gradient in one step of the
``allgather`` and ``sharded`` topologies, asynchronously, over a :mod:`~dqsgd.topology.group`.

The DDP hook (one rank per process, a ``torch.distributed`` group), the trainer's sharded step over
gloo (the same) and its simulation (W ranks of one in-process group) all call :meth:`Exchange.start`
and read the :class:`Outcome` their futures hold. One step of rank r:

1. encode all S shards of its bucket (one batched call where the codec has one) into one send
   buffer, each payload followed by rank r's *flag byte* (:data:`~dqsgd.topology.payloads.FLAG_NONFINITE`:
   its bucket held NaN/Inf and was encoded with them zeroed; :data:`~dqsgd.topology.payloads.FLAG_ZERO`:
   it abstains from a majority vote). The flag bytes travel inside the gradient's own collective:
   they are the one non-finite agreement (every rank sees every rank's flag);
2. the sizes: predicted for fixed-width payloads, else one all-gather of every rank's S sizes;
   every rank checks the same table against the caps (a refusal is the same on every rank);
3. ``sharded``: an all-to-all (rank j gets every rank's payload of shard j), rank j decodes and
   averages shard j and encodes its downlink (fixed: padded to the longest; coded: its exact bytes,
   the lengths all-gathered first), then one all-gather of the W downlink messages, each followed
   by a *status byte*: 0, or 1 when its shard server refused a payload (the message then holds the
   error's type and text, and every rank raises that error: the one way a refusal reaches every
   rank). ``allgather``: one all-gather; every rank decodes all W payloads itself;
4. decode; NaN everywhere where some rank's flag says non-finite (then no memory changes and the
   policy skips the step); the policy is fed (:meth:`BucketState.observe`, the one point).

The bytes each rank sends and receives are counted once, by :meth:`Topology.legs` of the
protocol's topology with the size tables' all-gathers added, through the ``count`` callback of the
caller (a budgeted policy pays them: :meth:`BucketProtocol.charge_side`); a topology that splits the ranks
in groups (:meth:`Topology.split`) also gets the bytes of the groups' updates this rank receives, as
the entries of :attr:`Outcome.down` past its shards' (its legs count them, in the downlink phase).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from dqsgd.topology import payloads as codec
from dqsgd.topology.figures import figures_table, observes, own_figures, worker_sums
from dqsgd.topology.group import DOWN, UP, after, done, release, then
from dqsgd.topology.refusal import check_sizes, failure_message, refused
from dqsgd.topology.registry import Legs
from dqsgd.topology.scatter import ShardStats

from dqsgd.topology.state import BucketState, Memory

if TYPE_CHECKING:
    from dqsgd.topology.bucket import BucketProtocol
    from dqsgd.topology.group import Group

__all__ = ["Exchange", "Outcome", "RankExchange", "in_process", "size_table"]

Count = Callable[[Legs, bool], None]  # (legs, whole: the step's first count, not a coded downlink's late one)


@dataclass
class Outcome:
    """One rank's view of one step of a bucket."""

    update: torch.Tensor         # G, float32, flat: the same on every rank (NaN: some rank was non-finite)
    bad: torch.Tensor            # some rank's bucket was non-finite (a 0-dim bool tensor)
    table: list[list[int]]       # table[w][j]: bytes of rank w's payload for shard j (a topology that splits
                                 # the ranks in groups: the group's ranks, then the W ranks once gathered)
    down: list[int]              # down[j]: bytes of shard j's downlink payload (allgather: none); then, where
                                 # the topology splits the ranks in groups, bytes of each other group's update
    sent: list[torch.Tensor]     # this rank's uplink payloads, one per shard
    side: int = 0                # bytes of the shared scalers (TernGrad), each way
    encode_s: float = 0.0        # seconds this rank spent encoding


def size_table(group: Group, mine: list[int], fixed: bool, device: torch.device) -> Any:
    """Every rank's payload sizes (W rows of len(mine)): known without a collective for fixed widths,
    where every rank's are the same; else a future of one small all-gather on the uplink leg."""
    if fixed:
        return [mine] * group.size
    t = torch.tensor(mine, dtype=torch.int64, device=device)
    return then(group.all_gather(t, UP), lambda rows: torch.stack(rows).tolist())


class Exchange:
    """The exchange of the bucket whose state is ``state`` (its protocol says the topology).
    ``flag_nonfinite``: a non-finite bucket is encoded zeroed and flagged (the hook); else the
    quantizer's NonFiniteGradientError is raised (the trainer checks before). ``count(legs, whole)``:
    told each rank's bytes. ``scatter`` (``sharded``; FSDP's reduce-scatter): rank j's outcome is
    its averaged shard j alone; the downlink is one all-gather of a status message per rank (its
    partial statistics of G for the policy, :class:`~dqsgd.topology.scatter.ShardStats`, or its refusal)."""

    def __init__(self, state: BucketState, *, flag_nonfinite: bool = True, count: Count | None = None,
                 scatter: bool = False, rank: Callable[..., Any] | None = None):
        self.state, self.flag_nonfinite, self._counter = state, flag_nonfinite, count
        self.scatter = scatter
        self._rank = rank  # the class of one rank's part (None: RankExchange; a server's: dqsgd.topology.server)

    def start(self, ranks: Mapping[int, tuple[torch.Tensor, Group, Memory]]) -> dict[int, torch.futures.Future]:
        """Start one step for the local ranks ``ranks`` (rank -> its flat gradient, its group view,
        its memory): a future of each one's :class:`Outcome`. Call it for the bucket in the same order
        on every process (the collectives of a leg are issued in that order)."""
        b = self.state
        step, bits, dbits = b.step, b.bits, b.proto.down_width(b.policy)
        b.step += 1
        first = next(iter(ranks))
        cls = self._rank or RankExchange
        return {r: cls(self, r, flat, g, mem, step, bits, dbits, r == first).start()
                for r, (flat, g, mem) in ranks.items()}

    def count(self, legs: Legs, whole: bool = True) -> None:
        """Tell the caller one rank's bytes (from completion callbacks too: the caller's count is thread-safe)."""
        if self._counter is not None:
            self._counter(legs, whole)


class RankExchange:
    """One rank's part of one step (module docstring), as a chain of futures."""

    gathers_figures = True  # a policy fed the workers' norms gets every rank's figures (a server: its own)

    def __init__(self, ex: Exchange, rank: int, flat: torch.Tensor, group: Group, mem: Memory, step: int, bits: int,
                 dbits: int, feeds: bool):
        self.ex, self.b, self.P = ex, ex.state, ex.state.proto
        self.g, self.outer = self.P.kind.split(group)  # the sequence's group; the groups averaged after it
        self.r, self.j, self.mem, self.W = rank, self.g.rank, mem, self.g.size  # worker r serves shard j
        self.step, self.bits, self.dbits, self.feeds = step, bits, dbits, feeds
        self.side, self.encode_s, self.send, self.lengths = 0, 0.0, None, None
        self.tables = 0  # bytes of the size table sent to the peers (counted in the uplink leg)
        self.norms = self.sample = None  # scatter: G's norms and policy sample, gathered from the ranks
        self.figures: list[list[float]] | None = None  # every rank's (‖x‖², ‖Q(x) − x‖²): a policy fed them
        self.x, self.flags = self._input(flat)

    def _input(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bucket as float32, and where it is checked before encoding (a device, or shared scalers)
        zeroed where non-finite with its flag byte (a device tensor: no host sync)."""
        x = flat.detach().reshape(-1).to(torch.float32)
        if not self.ex.flag_nonfinite or (not codec.device_path(x) and not self.b.method.shares_scalers):
            return x, None
        finite = torch.isfinite(x)
        x = x.masked_fill(~finite, 0.0)
        flags = (~finite.all()).to(torch.uint8)
        if self.P.vote:
            flags = flags | ((x == 0).all().to(torch.uint8) * codec.FLAG_ZERO)
        return x, flags.reshape(1)

    def start(self) -> torch.futures.Future:
        turns = [self.g.turns.turn(UP)] + ([self.g.turns.turn(DOWN)] if self.P.kind.sharded else [])
        self.mine = [m for _, m in turns]
        f = then(turns[0][0], self._scalers)
        f = then(f, self._encode)
        f = then(f, self._uplink)
        if self.P.kind.sharded and self.ex.scatter:
            f = then(then(after(f, turns[1][0]), self._scatter), self._scattered)
        elif self.P.kind.sharded:
            f = then(then(after(f, turns[1][0]), self._serve), self._assemble)
        else:
            f = then(f, self._gathered)
        if self.outer is not None:
            prev, mine = self.outer.turns.turn(DOWN)
            self.mine.append(mine)
            f = then(after(f, prev), self._across)
        f = then(f, self._feed)

        def free(_: torch.futures.Future) -> None:  # a failed step gives up its turns too
            for m in self.mine:
                release(m)

        f.add_done_callback(free)
        return f

    # --- uplink ----------------------------------------------------------------------------------
    def _scalers(self, _: Any) -> Any:
        """TernGrad: every shard's per-tensor scalers, max-reduced over the ranks."""
        if not self.b.method.shares_scalers:
            return None
        return self.g.max_reduce(self.P.local_scalers(self.x.cpu()), UP)

    def _encode(self, scalers: torch.Tensor | None) -> Any:
        """Every shard's payload and the send buffer (the flag byte after each), then the size table."""
        from dqsgd.quantizers import NonFiniteGradientError

        if self.flags is not None and self.b.method.config.dynamic:  # every width compiled once, before it is used
            from dqsgd.topology.warm import warm_widths

            c = self.b.method.config
            warm_widths(self.P, self.x, range(c.min_bits, c.max_bits + 1), self.W)
        t0 = time.perf_counter()
        self.side = 0 if scalers is None else 4 * scalers.numel()
        if self.flags is not None:
            self.sent = self._encode_each(scalers)
        else:
            bad = 0
            try:
                got = self._encode_cpu(scalers)
            except NonFiniteGradientError as e:
                if not self.ex.flag_nonfinite:
                    raise self.P.nonfinite(e, self.step, self.r) from None
                bad = codec.FLAG_NONFINITE
                self.x = torch.nan_to_num(self.x, nan=0.0, posinf=0.0, neginf=0.0)
                got = self._encode_cpu(scalers)
            flag = bad | (codec.FLAG_ZERO if self.P.vote and not self.x.any() else 0)
            self.flags = torch.tensor([flag], dtype=torch.uint8)
            if isinstance(got, list):
                self.sent = got
            else:
                self.send, sizes = got
                self.sent = codec.set_flags(self.send, sizes, flag)
        self.encode_s = time.perf_counter() - t0
        return self._size_table()

    def _scratch(self) -> Any:
        """The codec calls inside take their scratch buffers from this rank's workspace for the bucket
        (:mod:`dqsgd.kernels.workspace`) on the device path; elsewhere fresh ones. Imported here: importing
        the hook loads no kernel module."""
        from dqsgd.kernels.workspace import use as use_workspace

        return use_workspace(self.mem.workspace if codec.device_path(self.x) else None)

    def _size_table(self) -> Any:
        """Every rank's payload sizes, or a future of them (:func:`size_table`); for a policy fed the
        workers' norms (the link policy), with this rank's figures riding along (:func:`figures_table`)."""
        mine = [p.numel() for p in self.sent]
        fed = self.gathers_figures and getattr(self.P.policy, "needs_worker_norms", False)
        if not (fed and observes(self.P.policy, self.step)) or self.outer is not None:
            fixed = codec.fast_path(self.b.method)
            self.tables = 0 if fixed else 8 * len(mine) * (self.W - 1)
            return size_table(self.g, mine, fixed, self.x.device)
        figures = own_figures(self.P, self.sent, self.x, self.bits)
        self.tables = 8 * (len(mine) + len(figures)) * (self.W - 1)
        return then(figures_table(self.g, mine, figures, self.x.device), self._keep_figures)

    def _keep_figures(self, got: tuple[list[list[int]], list[list[float]]]) -> list[list[int]]:
        self.figures = got[1]
        return got[0]

    def _encode_cpu(self, scalers: torch.Tensor | None) -> list[torch.Tensor] | tuple[torch.Tensor, list[int]]:
        """Written in place into the send buffer where :func:`codec.encode_messages` applies, else a list."""
        if scalers is None:
            rngs = [self.P.uplink_rng(self.step, self.r, j) for j in range(len(self.P.shards))]
            got = codec.encode_messages(self.P.shards, self.P.bounds, self.x, self.bits, rngs)
            if got is not None:
                return got
        return self._encode_each(scalers)

    def _encode_each(self, scalers: torch.Tensor | None) -> list[torch.Tensor]:
        """:meth:`BucketProtocol.encode`, this rank's memory in and its new residuals staged."""
        res_in = [self.mem.residuals.get(j) for j in range(len(self.P.shards))]
        with self._scratch():
            out, res = self.P.encode(self.r, self.x, self.bits, self.step, self.mem.generator, res_in, scalers)
        self.mem.staged = {j: t for j, t in enumerate(res) if t is not None} or None
        return out

    def _uplink(self, table: list[list[int]]) -> torch.futures.Future:
        """Check the sizes, count the bytes, issue the uplink's collective (then this rank's uplink turn ends)."""
        self.P.check_sizes(table, self.bits, f"rank {self.r}: bucket {self.P.numel} elements: ")
        self.table, r = table, self.j
        if self.P.kind.sharded:
            send = self.send if self.send is not None else codec.messages(self.sent, self.flags)
            self.recv_sizes = [row[r] + 1 for row in table]
            self.dmsg = max(self.P.down_sizes(self.dbits)) + 1  # the longest downlink payload and the status byte
            if self.ex.scatter:
                self.dmsg = ShardStats(self.P).size + 1
            down = [0 if self.P.coded_down else self.dmsg] * self.W  # a coded downlink: counted once its sizes are known
            self.ex.count(self.P.kind.legs([[n + 1 for n in row] for row in table], down, r).plus(self.tables))
            fut = self.g.all_to_all(send, [n + 1 for n in table[r]], self.recv_sizes, UP)
        else:
            size = max(row[0] for row in table) + 1
            msg = self.send if self.send is not None and self.send.numel() == size else torch.cat(
                [codec.pad(self.sent[0], size - 1), self.flags.reshape(1)])
            self.ex.count(self.P.kind.legs([[row[0] + 1] for row in table], [], r).plus(self.tables))
            fut = self.g.all_gather(msg, UP)
        release(self.mine[0])
        return fut

    def _average(self, shard: int, payloads: list[torch.Tensor], flags: torch.Tensor) -> torch.Tensor:
        """Shard ``shard`` aggregated from the ranks' payloads, float32 on the bucket's device."""
        if self.P.vote:
            voters = [not f & codec.FLAG_ZERO for f in flags.cpu().tolist()]
            return self.P.reduce(shard, payloads, self.bits, voters).to(self.x.device)
        out = torch.empty(self.P.shards[shard].numel, dtype=torch.float32, device=self.x.device)  # written, not read
        return self.P.reduce(shard, payloads, self.bits, out=out, bad=self.b.payload_flag(out))

    def _gathered(self, gathered: list[torch.Tensor]) -> Outcome:
        """``allgather``: every rank's message is here; average them all."""
        flags = torch.stack([m[-1] for m in gathered])
        avg = self._average(0, [m[:row[0]] for m, row in zip(gathered, self.table)], flags)
        return self._finish(avg, flags, self.P.spent_bits(self.table), [])

    # --- downlink (sharded) ----------------------------------------------------------------------
    def _serve(self, recv: torch.Tensor) -> torch.futures.Future:
        """Rank r serves shard r: average it, encode its downlink (or the refusal), issue the all-gather."""
        from dqsgd.codecs import PayloadError
        from dqsgd.method.pipeline import ProtocolError

        P, r, coded = self.P, self.j, self.P.coded_down
        msgs = recv.split(self.recv_sizes)
        self.flg = torch.stack([m[-1] for m in msgs])  # the flag byte ending each message (no host-made index)
        try:
            with self._scratch():
                avg = self._average(r, [m[:-1] for m in msgs], self.flg)
                mine, self.mem.down_staged = P.encode_down_fed(r, avg, self.step, self.mem.down_residual,
                                                               None if coded else self.dmsg,
                                                               self.b.payload_flag(avg), self.dbits)
            if coded:  # its exact bytes and the status byte 0 (fixed: zero padded, the last byte 0)
                mine = torch.cat([mine, torch.zeros(1, dtype=torch.uint8, device=mine.device)])
        except (PayloadError, ProtocolError) as e:  # told to every rank, in the downlink itself
            mine = failure_message(e, P.down_caps(self.dbits)[r] + 1 if coded else self.dmsg, self.x.device)
        if not coded:
            fut = self.g.all_gather(mine, DOWN)
            release(self.mine[1])
            return fut
        size = torch.tensor([mine.numel()], dtype=torch.int64, device=mine.device)
        return then(self.g.all_gather(size, DOWN), lambda rows: self._coded(mine, rows))

    def _coded(self, mine: torch.Tensor, rows: list[torch.Tensor]) -> torch.futures.Future:
        """A coded downlink's lengths are known: check them, count them, all-gather the messages."""
        self.lengths = [int(n) for n in torch.cat(rows).tolist()]
        caps = self.P.down_caps(self.dbits)
        for j, n in enumerate(self.lengths):  # rank j serves shard j
            check_sizes([n - 1], [caps[j]], f"rank {self.r}: the coded downlink of bucket {self.P.numel}: rank {j} "
                                            f"(the server of shard {j})")
        self.ex.count(self.P.kind.legs([[0] * self.W] * self.W, self.lengths, self.j).plus(0, 8 * (self.W - 1)), False)
        fut = self.g.all_gather(codec.pad(mine, max(self.lengths)), DOWN)
        release(self.mine[1])
        return fut

    def _assemble(self, gathered: list[torch.Tensor]) -> Outcome:
        """Decode every shard server's downlink into the bucket (the same bytes on every rank). A shard
        server that refused a payload: every rank raises its error (CPU) or flags the bucket (device)."""
        from dqsgd.codecs import PayloadError
        from dqsgd.method.pipeline import ProtocolError

        from dqsgd.kernels.workspace import scratch

        with self._scratch():  # the sum (the outcome is a fresh copy of it, :meth:`_finish`)
            out = scratch("update", self.P.numel, torch.float32, self.x.device)  # decode_down writes it, reads nothing
        flag = self.b.payload_flag(out)
        if self.lengths is not None:  # each message's exact payload, then its status byte
            gathered = [m[:n] for m, n in zip(gathered, self.lengths)]
        status = torch.stack([m[-1] for m in gathered])
        if flag is None:
            refused(gathered, lambda j: f"rank {self.r}: step {self.step}: rank {j} (the server of shard {j}) refused "
                                        "a payload")
        else:
            flag |= (status != 0).any()
        with self._scratch():
            self.P.decode_down([m[:-1] for m in gathered], out, flag, self.dbits)
        down = [n - 1 for n in self.lengths] if self.lengths is not None else list(self.P.down_sizes(self.dbits))
        return self._finish(out, self.flg, self.P.spent(self.table, self.dbits, down), down)

    def _finish(self, out: torch.Tensor, flags: torch.Tensor, spent: Any, down: list[int]) -> Outcome:
        """The one non-finite agreement (any rank's flag: NaN everywhere, no memory changes, the policy
        skips the step); a vote nobody cast stays 0."""
        bad = (flags & codec.FLAG_NONFINITE).any().to(torch.bool)  # uint8 flags: any() keeps their dtype
        self.mem.commit(bad)
        self.spent = spent
        if self.P.vote:
            out = torch.where((flags & codec.FLAG_ZERO).all().to(torch.bool), torch.zeros((), device=out.device), out)
        if not codec.device_path(out):
            if bool(bad):
                out.fill_(float("nan"))
        else:
            out = out.masked_fill(bad, float("nan"))  # a fresh tensor: the caller keeps it
        return Outcome(out, bad, self.table, down, self.sent, self.side, self.encode_s)

    def _across(self, o: Outcome) -> torch.futures.Future:
        """A hierarchical topology: the mean of the groups' updates, Σ_g (1/n)·G_g in group order (the
        same bytes on every rank), gathered over the groups' ranks (:meth:`Topology.split`)."""
        assert self.outer is not None
        shards, across = len(o.down), [o.update.numel() * o.update.element_size()] * (self.outer.size - 1)
        o.down = [*o.down, *across]  # past the shards': each other group's update, as the topology's legs reads it
        self.ex.count(self.P.kind.legs([[0] * len(row) for row in self.table], [0] * shards + across, self.j), False)
        fut = self.outer.all_gather(o.update, DOWN)
        if codec.fast_path(self.b.method):  # sizes known: every group's table is this one
            tables = done([o.table] * self.outer.size)
        else:  # the groups' tables, in group order (the W ranks' rows: the step's ledger reads them)
            tables = then(self.outer.all_gather(torch.tensor(o.table, dtype=torch.int64, device=o.update.device), DOWN),
                          lambda rows: [t.tolist() for t in rows])
        release(self.mine[-1])

        def mean(_: Any) -> Outcome:
            rows = fut.value()
            out = torch.zeros_like(o.update)
            for u in rows:
                out.add_(u * (1.0 / len(rows)))
            o.update, o.bad = out, o.bad | torch.isnan(out).any()
            o.table = [row for t in tables.value() for row in t]
            return o

        return then(torch.futures.collect_all([fut, tables]), mean)

    def _feed(self, o: Outcome) -> Outcome:
        """The policy fed, once per process and step, the update every rank holds."""
        if self.feeds:
            from dqsgd.policies.budgeted import charged_spent

            spent = charged_spent(self.spent, self.P.side_bits) if self.P.side_bits else self.spent
            self.b.observe(o.update, self.step, spent, o.bad, norms=self.norms, sample=self.sample,
                           workers=self._workers(o))
        return o

    def _workers(self, o: Outcome) -> tuple[float, float, int] | None:
        """The ranks' figures summed for the policy (:func:`~dqsgd.topology.figures.worker_sums`), if gathered."""
        if self.figures is None:
            return None
        return worker_sums(self.figures, self.P, self.dbits, o.update, self.b.method.p)

    # --- scatter (FSDP's reduce-scatter): rank j keeps shard j -----------------------------------
    def _scatter(self, recv: torch.Tensor) -> torch.futures.Future:
        """Average shard j, then one all-gather of every rank's status message: its partial statistics
        of G (:class:`~dqsgd.topology.scatter.ShardStats`), or the error of a payload it refused."""
        from dqsgd.codecs import PayloadError
        from dqsgd.method.pipeline import ProtocolError

        msgs = recv.split(self.recv_sizes)
        self.flg = recv[torch.tensor(self.recv_sizes).cumsum(0) - 1]  # the flag byte ending each message
        try:
            with self._scratch():
                self.avg = self._average(self.j, [m[:-1] for m in msgs], self.flg)
            mine = codec.pad(ShardStats(self.P).partial(self.avg, self.j), self.dmsg)  # its last byte: status 0
        except (PayloadError, ProtocolError) as e:  # told to every rank in the status message
            mine = failure_message(e, self.dmsg, self.x.device)
        fut = self.g.all_gather(mine, DOWN)
        release(self.mine[1])
        return fut

    def _scattered(self, gathered: list[torch.Tensor]) -> Outcome:
        """Every rank's status: raise the first refusal, else G's statistics for the policy."""
        refused(gathered, lambda j: f"rank {self.r}: step {self.step}: rank {j} refused a payload it received")
        self.norms, self.sample = ShardStats(self.P).combine(gathered)
        return self._finish(self.avg, self.flg, self.P.spent_bits(self.table), [])


def in_process(proto: BucketProtocol, flats: Sequence[torch.Tensor], bits: int, step: int,
               generators: Sequence[torch.Generator | None] | None = None, dbits: int | None = None) -> torch.Tensor:
    """One step of ``proto`` for W workers' flat gradients in one process (the exchange over an
    in-process group), without memory or scalers: the update every rank applies. ``dbits``: the
    step's downlink width (``downlink_bits = "auto"``; None: the fixed width)."""
    from types import SimpleNamespace

    from dqsgd.topology.group import local_groups

    gens = generators if generators is not None else [None] * len(flats)
    b = BucketState(numel=proto.numel, proto=proto, policy=SimpleNamespace(bits=bits, down_bits=dbits), step=step)
    groups = local_groups(len(flats))
    futures = Exchange(b).start({w: (g, groups[w], Memory(generator=gens[w])) for w, g in enumerate(flats)})
    return groups[0].wait(futures[0]).update

