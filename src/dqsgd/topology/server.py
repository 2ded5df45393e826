"""The exchange of a topology with one server (``ps``): one rank's part of one step, over a group.

It is :class:`~dqsgd.topology.exchange.Exchange`'s sequence (:class:`~dqsgd.topology.exchange.RankExchange`:
input, shared scalers, encoding, the size table, the flag bytes, the refusal, the non-finite
agreement) with the legs of a parameter server (DQSGD Algorithm 2), rank 0 the server:

1. uplink: every rank's message (its payload padded to the longest of the size table, then its flag
   byte) is gathered on rank 0 (:meth:`Group.gather`);
2. rank 0 decodes and averages them (or the ranks ``pick`` names: backup workers, the first W − b
   arrivals), feeds the policy with the aggregate and learns B_{n+1} from it, and encodes the
   downlink (fp32, or a vote's signs);
3. downlink: rank 0 broadcasts one message of a size every rank knows: the payload, B_{n+1} (int64),
   the step's flag byte (some rank non-finite; every voter abstained), zero padding up to
   :data:`ROOM` bytes where it is shorter, and the status byte — 0, or 1
   when the server refused a payload (the message then holds the error's type and text, and every
   rank raises it, as with a sharded downlink);
4. every rank decodes the same bytes into the update; a rank without the server holds B_{n+1} as
   :class:`Width` (the policy runs on the server only).

A group whose gather serves by arrival (:attr:`arrivals`: the backup workers' transport over
processes) sends its exact message without a size table; its gather gives None for a rank it did not
wait for, and the server aggregates the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from dqsgd.topology import payloads as codec
from dqsgd.topology.exchange import Outcome, RankExchange
from dqsgd.topology.refusal import ROOM, failure_message, opened
from dqsgd.topology.group import DOWN, UP, after, release, then

if TYPE_CHECKING:
    from dqsgd.topology.group import Group

__all__ = ["ServerRank", "Width", "refusable", "releasing", "room", "settle"]

SERVER = 0
_BITS = 8  # B_{n+1}, int64, in the downlink message


def room(size: int) -> int:
    """The size of a message of ``size`` bytes (its status byte included) that may carry a refusal instead."""
    return max(size, ROOM + 1)


@dataclass(frozen=True)
class Width:
    """The policy state of a rank that does not run the policy: only B_n, as the server sent it."""

    bits: int


class ServerRank(RankExchange):
    """One rank's part of one ``ps`` step (module docstring). ``pick(sizes)``: the ranks whose payloads
    the server aggregates, from every rank's payload bytes (None: all of them)."""

    gathers_figures = False  # the server holds the policy and the simulation hands it exact norms

    def __init__(self, *args: Any, pick: Callable[[list[int]], Sequence[int]] | None = None):
        super().__init__(*args)
        self.pick, self.serves = pick, self.g.rank == SERVER
        self.arrivals = bool(getattr(self.g, "arrivals", False))
        self.n = self.P.down_sizes()[0]
        self.dmsg = room(self.n + _BITS + 2)  # payload, B_{n+1}, flag byte, (padding), status byte

    def start(self) -> torch.futures.Future:
        (up, self.up_mine), (down, self.down_mine) = self.g.turns.turn(UP), self.g.turns.turn(DOWN)
        f = then(then(up, self._scalers), self._encode)
        f = then(after(then(f, self._uplink), down), self._serve)
        return releasing(then(f, self._received), self.up_mine, self.down_mine)

    def _size_table(self) -> Any:
        """By arrival, no size table: each message announces its own size."""
        return [[self.sent[0].numel()]] if self.arrivals else super()._size_table()

    def _uplink(self, table: list[list[int]]) -> torch.futures.Future:
        """Check the sizes, issue the gather on the server (padded to the longest, then the flag byte)."""
        self.P.check_sizes(table, self.bits, f"rank {self.r}: bucket {self.P.numel} elements: ")
        self.table = table
        size = max(row[0] for row in table) + 1
        msg = torch.cat([codec.pad(self.sent[0], size - 1), self.flags.reshape(1).to(self.sent[0].device)])
        if self.arrivals:
            fut = self.g.gather(msg, SERVER, UP, cap=self.P.caps(self.bits)[0] + 1)
        else:
            self.ex.count(self.P.kind.legs([[row[0] + 1] for row in table], [self.dmsg], self.j))
            fut = self.g.gather(msg, SERVER, UP)
        release(self.up_mine)
        return fut

    def _serve(self, gathered: list[torch.Tensor | None] | None) -> torch.futures.Future:
        """The server aggregates, feeds the policy, encodes the downlink (or the refusal); every rank
        takes part in its broadcast."""
        from dqsgd.codecs import PayloadError
        from dqsgd.method.pipeline import ProtocolError

        msg = torch.zeros(self.dmsg, dtype=torch.uint8, device=self.x.device)
        if self.serves:
            assert gathered is not None
            try:
                msg = self._aggregate(gathered)
            except (PayloadError, ProtocolError) as e:  # told to every rank, in the downlink itself
                msg = failure_message(e, self.dmsg, self.x.device)
        fut = self.g.broadcast(msg, SERVER, DOWN)
        release(self.down_mine)
        return fut

    def _aggregate(self, gathered: list[torch.Tensor | None]) -> torch.Tensor:
        """The server's downlink message: the aggregate of the used ranks' payloads, B_{n+1} learnt from it."""
        from dqsgd.policies.budgeted import charged_spent

        b, P = self.b, self.P
        if self.arrivals:  # the exact messages of the ranks waited for
            self.table = [[0 if m is None else m.numel() - 1] for m in gathered]
        sizes = [row[0] for row in self.table]
        used = [w for w, m in enumerate(gathered) if m is not None]
        if self.pick is not None:
            used = [w for w in self.pick(sizes) if gathered[w] is not None]
        self.table = [self.table[w] for w in used]
        flags = torch.stack([gathered[w][-1] for w in used])  # type: ignore[index]
        avg = self._average(0, [gathered[w][: sizes[w]] for w in used], flags)  # type: ignore[index]
        bad = (flags & codec.FLAG_NONFINITE).any()
        zero = (flags & codec.FLAG_ZERO).all() if P.vote else torch.zeros((), dtype=torch.bool)
        b.observe(avg, self.step, charged_spent(P.spent_bits(self.table), P.side_bits), bad.to(torch.bool))
        b.catch_up(self.step)  # B_{n+1}, before the downlink leaves
        down = P.encode_down(0, avg, self.step)
        flag = int(bad) * codec.FLAG_NONFINITE | int(zero) * codec.FLAG_ZERO
        tail = torch.tensor([b.bits], dtype=torch.int64).view(torch.uint8)
        msg = codec.pad(torch.cat([down.cpu(), tail, torch.tensor([flag], dtype=torch.uint8)]), self.dmsg)
        return msg.to(self.x.device)

    def _received(self, msg: torch.Tensor) -> Outcome:
        """Decode the server's message into the update (the same bytes on every rank), or raise its refusal."""
        opened(msg, f"rank {self.r}: step {self.step}: the server (rank {SERVER})")
        n = self.n
        nxt = int(msg[n : n + _BITS].cpu().clone().view(torch.int64)[0])
        if not self.serves and self.feeds:  # a process without the server holds the width it sent
            self.b.policy = Width(nxt)
        out = self.P.decode_down([msg[:n]])
        if not self.serves:
            self.table = [] if self.arrivals else self.table
        return self._finish(out, msg[n + _BITS : n + _BITS + 1], None, [n])


def releasing(f: torch.futures.Future, *turns: torch.futures.Future) -> torch.futures.Future:
    """``f``, whose completion gives up ``turns`` (:func:`~dqsgd.topology.group.release`): a failed step's too."""
    f.add_done_callback(lambda _: [release(m) for m in turns])
    return f


def settle(groups: Mapping[int, Group], futures: Mapping[int, torch.futures.Future]) -> dict[int, Any]:
    """Each local rank's value of its future, for a caller that waits (the trainer); the first failure
    raised is whichever rank met it first."""
    for w, f in futures.items():
        if f.done():
            groups[w].wait(f)
    return {w: groups[w].wait(f) for w, f in futures.items()}


def refusable(make: Callable[[], bytes], size: int | None) -> torch.Tensor:
    """A message of ``size`` bytes: ``make()``'s payload zero-padded, then the status byte 0; or where
    ``make`` refuses a payload it received (PayloadError, ProtocolError), that error's type and text
    and the status byte 1, which every rank that opens it raises (:func:`opened`). ``size`` None: the
    payload's own length and the status byte (a refusal: ``room(0)`` bytes), for a collective that
    carries each message at its length."""
    from dqsgd.codecs import PayloadError
    from dqsgd.method.pipeline import ProtocolError

    try:
        payload = make()
    except (PayloadError, ProtocolError) as e:
        return failure_message(e, room(0) if size is None else size, torch.device("cpu"))
    return codec.bytes_tensor(payload, torch.device("cpu"), len(payload) + 1 if size is None else size)
