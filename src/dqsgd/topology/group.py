"""The group an exchange runs over: a few asynchronous collectives, in two implementations.

:class:`~dqsgd.topology.exchange.Exchange` issues every collective through this interface and
continues in callbacks of the futures it returns, so nothing it does blocks its caller:

* :class:`TorchGroup` — one rank of a ``torch.distributed`` process group (gloo or NCCL): two groups
  of its own over the same ranks, made with a timeout, one per leg (:data:`UP`, :data:`DOWN`);
* :class:`LocalGroup` — one of W ranks that live in one process (the simulation): a collective
  completes when the last of the W ranks has issued it, and its callbacks run at once, in rank order.

A leg is an ordered channel: every rank issues a leg's collectives in the same order (the uplink's
from the caller, in bucket order; the downlink's from completion callbacks). :meth:`Turns.turn`
keeps that order: a bucket takes its place in both legs when it starts, and issues on a leg only
once the bucket before it has issued all of its collectives there.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist

__all__ = ["DOWN", "UP", "Group", "LocalGroup", "TorchGroup", "Turns", "after", "done", "gather_ints", "local_groups",
           "release", "then"]

UP, DOWN = 0, 1  # the legs: the uplink's collectives, the downlink's
Future = torch.futures.Future

# The hook's groups are held here for the life of the process: the completion callbacks capture them,
# and were a callback to drop the last reference the group's destructor would run on one of its own
# gloo threads and join it ("terminate called … Resource deadlock avoided": a rank dying with SIGABRT).
_LIVE_GROUPS: list[dist.ProcessGroup] = []


def done(value: Any = None) -> Future:
    """A completed future holding ``value``."""
    f: Future = Future()
    f.set_result(value)
    return f


def gather_ints(group: Group, values: Sequence[int]) -> list[list[int]]:
    """Every rank's ``values`` (same length everywhere), in rank order, waited for on the uplink leg
    (the rank agreement, :func:`dqsgd.topology.agreement.agree`)."""
    mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=group.device)
    rows = group.wait(group.all_gather(mine, UP))
    return [r.tolist() for r in rows]


def release(f: Future) -> None:
    """Complete a turn's future (once; a second call does nothing)."""
    if not f.done():
        f.set_result(None)


def then(fut: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of ``fn(fut's value)``; where ``fn`` returns a future, of that future's value. An
    exception (``fut``'s or ``fn``'s) fails the returned future with its own type."""
    out: Future = Future()

    def copy(f: Future) -> None:
        try:
            out.set_result(f.value())
        except Exception as e:  # noqa: BLE001 - handed on with its type
            out.set_exception(e)

    def run(f: Future) -> None:
        try:
            v = fn(f.value())
        except Exception as e:  # noqa: BLE001 - handed on with its type
            out.set_exception(e)
            return
        if isinstance(v, Future):
            v.add_done_callback(copy)
        else:
            out.set_result(v)

    fut.add_done_callback(run)
    return out


def after(first: Future, gate: Future) -> Future:
    """``first``'s value, once ``gate`` has completed too (its value and failure are not read)."""
    return then(torch.futures.collect_all([first, gate]), lambda _: first.value())


class Turns:
    """The order of one rank's buckets on each leg (module docstring)."""

    def __init__(self) -> None:
        self._last: list[Future] = [done(), done()]
        self._lock = threading.Lock()

    def turn(self, leg: int) -> tuple[Future, Future]:
        """(the previous bucket's future on ``leg``: completes once it has issued there; this bucket's, to
        :func:`release` once it has issued its own)."""
        mine: Future = Future()
        with self._lock:
            prev, self._last[leg] = self._last[leg], mine
        return prev, mine


class Group(Protocol):
    """One rank's view of the W ranks an exchange runs over (every collective returns a future)."""

    rank: int
    size: int
    turns: Turns
    device: torch.device

    def all_gather(self, t: torch.Tensor, leg: int) -> Future:
        """Every rank's ``t`` (equal shapes), in rank order: a future of the list."""
        ...

    def all_to_all(self, send: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int], leg: int) -> Future:
        """Piece j of ``send`` (``send_sizes[j]`` elements) to rank j: a future of what every rank sent
        this one, concatenated in rank order (``recv_sizes[w]`` from rank w)."""
        ...

    def max_reduce(self, t: torch.Tensor, leg: int) -> Future:
        """The element-wise max of every rank's ``t``."""
        ...

    def gather(self, t: torch.Tensor, dst: int, leg: int) -> Future:
        """Every rank's ``t`` (equal shapes), in rank order, on rank ``dst``: a future of the list
        there, of None on the other ranks."""
        ...

    def broadcast(self, t: torch.Tensor, src: int, leg: int) -> Future:
        """Rank ``src``'s ``t`` on every rank (the others pass a buffer of its shape): a future of it."""
        ...

    def wait(self, fut: Future) -> Any:
        """``fut``'s value for a caller that waits (the trainer); a failed collective raises the
        group's error, anything else its own."""
        ...

    def sub(self, members: Sequence[int]) -> Group:
        """The group of the ranks ``members`` (ranks of this group, this one among them), made once."""
        ...


class TorchGroup:
    """This process's rank of ``group`` (None: the world), over two new groups with ``timeout``
    (seconds; None: torch's default), one per leg. ``explain(err)``: the error a failed collective
    raises from :meth:`wait` (None: as it is). Every rank of ``group`` makes it at the same point."""

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: float | None = None,
                 explain: Callable[[BaseException], BaseException] | None = None,
                 device: torch.device | None = None, *, ranks: Sequence[int] | None = None):
        ranks = list(ranks) if ranks is not None else dist.get_process_group_ranks(group or dist.group.WORLD)
        self.ranks, self.timeout, self._subs = ranks, timeout, {}  # type: ignore[var-annotated]
        kw = {"timeout": timedelta(seconds=timeout)} if timeout is not None else {}
        self.pgs = (dist.new_group(ranks, use_local_synchronization=True, **kw),
                    dist.new_group(ranks, use_local_synchronization=True, **kw))
        _LIVE_GROUPS.extend(self.pgs)
        self.rank, self.size = dist.get_rank(self.pgs[0]), len(ranks)
        self.turns, self.explain = Turns(), explain
        self.device = device if device is not None else torch.device("cpu")

    def all_gather(self, t: torch.Tensor, leg: int) -> Future:
        out = [torch.empty_like(t) for _ in range(self.size)]
        work = dist.all_gather(out, t, group=self.pgs[leg], async_op=True)
        return then(work.get_future(), lambda _: out)

    def all_to_all(self, send: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int], leg: int) -> Future:
        recv = torch.empty(sum(recv_sizes), dtype=send.dtype, device=send.device)
        work = dist.all_to_all_single(recv, send, list(recv_sizes), list(send_sizes), group=self.pgs[leg],
                                      async_op=True)
        return then(work.get_future(), lambda _: recv)

    def max_reduce(self, t: torch.Tensor, leg: int) -> Future:
        x = t.clone()
        work = dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.pgs[leg], async_op=True)
        return then(work.get_future(), lambda _: x)

    def gather(self, t: torch.Tensor, dst: int, leg: int) -> Future:
        out = [torch.empty_like(t) for _ in range(self.size)] if self.rank == dst else None
        work = dist.gather(t, out, dst=self.ranks[dst], group=self.pgs[leg], async_op=True)
        return then(work.get_future(), lambda _: out)

    def broadcast(self, t: torch.Tensor, src: int, leg: int) -> Future:
        x = t if self.rank == src else t.clone()
        work = dist.broadcast(x, src=self.ranks[src], group=self.pgs[leg], async_op=True)
        return then(work.get_future(), lambda _: x)

    def wait(self, fut: Future) -> Any:
        from dqsgd.codecs import PayloadError
        from dqsgd.method.pipeline import ProtocolError

        try:
            return fut.wait()
        except (PayloadError, ProtocolError):
            raise
        except (RuntimeError, dist.DistError) as e:  # gloo/NCCL: peer closed, timeout, reset
            if self.explain is None:
                raise
            raise self.explain(e) from e

    def sub(self, members: Sequence[int]) -> TorchGroup:
        key = tuple(members)
        if key not in self._subs:  # only its members make it (use_local_synchronization)
            self._subs[key] = TorchGroup(None, self.timeout, self.explain, self.device,
                                         ranks=[self.ranks[i] for i in key])
        return self._subs[key]


class _Hub:
    """What the W ranks of one process share: per leg, the collectives not every rank has issued yet."""

    def __init__(self, size: int):
        self.size = size
        self.subs: dict[tuple[int, ...], _Hub] = {}
        self.pending: list[dict[int, tuple[str, dict[int, Any], dict[int, Future]]]] = [{}, {}]


class LocalGroup:
    """Rank ``rank`` of the W ranks of one process (:func:`local_groups`)."""

    def __init__(self, hub: _Hub, rank: int):
        self.hub, self.rank, self.size = hub, rank, hub.size
        self.turns, self.device = Turns(), torch.device("cpu")
        self._seq = [0, 0]
        self._subs: dict[tuple[int, ...], LocalGroup] = {}

    def sub(self, members: Sequence[int]) -> LocalGroup:
        key = tuple(members)
        if key not in self._subs:
            self._subs[key] = LocalGroup(self.hub.subs.setdefault(key, _Hub(len(key))), key.index(self.rank))
        return self._subs[key]

    def _call(self, leg: int, kind: str, arg: Any, combine: Callable[[list[Any]], list[Any]]) -> Future:
        seq, self._seq[leg] = self._seq[leg], self._seq[leg] + 1
        got, args, futs = self.hub.pending[leg].setdefault(seq, (kind, {}, {}))
        if got != kind:
            raise RuntimeError(f"in-process group: rank {self.rank} issued {kind} where another rank issued {got}")
        fut: Future = Future()
        args[self.rank], futs[self.rank] = arg, fut
        if len(args) == self.size:
            del self.hub.pending[leg][seq]
            for r, v in enumerate(combine([args[w] for w in range(self.size)])):
                futs[r].set_result(v)
        return fut

    def all_gather(self, t: torch.Tensor, leg: int) -> Future:
        return self._call(leg, "all_gather", t, lambda ts: [list(ts)] * len(ts))

    def all_to_all(self, send: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int], leg: int) -> Future:
        def combine(args: list[tuple[torch.Tensor, Sequence[int]]]) -> list[torch.Tensor]:
            pieces = [s.split(list(n)) for s, n in args]
            return [torch.cat([p[r] for p in pieces]) for r in range(len(args))]

        return self._call(leg, "all_to_all", (send, send_sizes), combine)

    def max_reduce(self, t: torch.Tensor, leg: int) -> Future:
        return self._call(leg, "max_reduce", t, lambda ts: [torch.stack(ts).amax(dim=0)] * len(ts))

    def gather(self, t: torch.Tensor, dst: int, leg: int) -> Future:
        return self._call(leg, f"gather to {dst}", t, lambda ts: [list(ts) if r == dst else None for r in range(len(ts))])

    def broadcast(self, t: torch.Tensor, src: int, leg: int) -> Future:
        return self._call(leg, f"broadcast from {src}", t, lambda ts: [ts[src]] * len(ts))

    def wait(self, fut: Future) -> Any:
        if not fut.done():
            raise RuntimeError(f"in-process group: rank {self.rank}'s exchange did not complete (another rank "
                               "stopped before a collective)")
        return fut.value()


def local_groups(size: int) -> list[LocalGroup]:
    """The W ranks of one in-process group, in rank order."""
    hub = _Hub(size)
    return [LocalGroup(hub, r) for r in range(size)]
