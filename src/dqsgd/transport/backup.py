"""Backup workers over torch.distributed: a parameter server that aggregates the first W − b arrivals.

Topology ``ps``, one worker per rank, rank 0 the server and worker 0. Unlike
:class:`~dqsgd.transport.torch_dist.TorchPSTransport` nothing here is a collective, so a stalled or dead
worker blocks no one (the pattern of the Double Quantization master, :mod:`dqsgd.dq.dist`):

* uplink: a worker sends (exchange index, size) and then its payload to rank 0, point to point;
* the server counts its own payload as the first arrival, then takes the payloads in the order its
  receives (one posted per live worker) complete until it holds W − b of the current exchange — arrival
  order, which is not deterministic. It aggregates those, in worker order; :attr:`used` and
  :attr:`dropped` name the workers;
* a payload of an earlier exchange (a straggler's) is read and discarded: :attr:`late` lists
  (exchange, worker, bytes) of each one, the wasted bytes, for the ledger;
* downlink: the server sends the update and B_{n+1} to every live worker without waiting for it
  (a straggler reads its queued downlinks when it gets there); a send that fails marks the rank dead;
* after the last exchange (:meth:`expect` says how many) the server drains what the live workers
  still send, up to ``timeout``, and waits for its downlinks to be delivered.

What is reproducible: the arrival order is not, so the run is not a function of the seed. Given the
recorded dropped workers of every exchange (the ledger's ``dropped``, the metrics' ``dropped``), the
model is: the simulation replays them (``BackupGather.replay``) bitwise.

Numbers that other transports reduce across ranks stay local here: ``mean_loss`` is this rank's own
loss (the server logs worker 0's), ``max_reduce`` this rank's tensor (a non-finite gradient stops the
rank that computed it; the server then drops that worker like a dead one). ``all_gather_ints`` stays a
collective, used only before the first step (the ranks' config agreement).
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from dqsgd.codecs import PayloadError
from dqsgd.method.pipeline import ProtocolError
from dqsgd.topology.group import Turns, done
from dqsgd.topology.refusal import check_sizes
from dqsgd.topology.payloads import bytes_tensor, tensor_bytes
from dqsgd.transport.torch_dist import TorchPSTransport, TransportError

__all__ = ["BackupPSTransport"]

UP_HEAD, UP_DATA, DOWN_HEAD, DOWN_DATA = 21, 22, 23, 24
OK, FAILED = 0, 1  # a downlink header's status
MESSAGE_CAP = 1 << 16  # the most bytes of an error message in a downlink header
# Errors re-raised with their own type on the ranks that learn of them from the server.
_REMOTE_TYPES: dict[str, type[Exception]] = {"PayloadError": PayloadError, "ProtocolError": ProtocolError}
_POLL_S = 0.001


class _Waiting:
    """gloo's point-to-point works complete only inside ``wait()``: a daemon thread waits (at most
    ``timeout_s``) so that the caller can poll :attr:`done` while it watches the other ranks."""

    def __init__(self, works: Sequence[Any], timeout_s: float):
        self.done, self.error = threading.Event(), None
        self.when = math.inf  # monotonic time of completion: the arrival order
        self.works = list(works)  # kept while a failed receive may still be posted in gloo
        threading.Thread(target=self._run, args=(works, datetime.timedelta(seconds=timeout_s)), daemon=True).start()

    def _run(self, works: Sequence[Any], timeout: datetime.timedelta) -> None:
        try:
            for w in works:
                w.wait(timeout=timeout)
        except Exception as e:  # noqa: BLE001 — reported by the poller, with the rank and operation
            self.error = e
        finally:
            self.when = time.monotonic()
            self.done.set()


class ArrivalGroup:
    """The group a ``ps`` exchange (:mod:`dqsgd.topology.server`) runs over on a :class:`BackupPSTransport`:
    its gather serves by arrival (None for a rank not waited for), its broadcast is point to point."""

    arrivals = True

    def __init__(self, t: BackupPSTransport):
        self.t, self.rank, self.size = t, t.rank, t.workers
        self.turns, self.device = Turns(), torch.device("cpu")

    def gather(self, msg: torch.Tensor, dst: int, leg: int, cap: int = 0) -> torch.futures.Future:
        """The W − b first messages on the server (rank ``dst`` = 0), each a payload and its flag byte,
        whose payload bytes the transport records (:attr:`BackupPSTransport.sizes`, ``late``)."""
        t = self.t
        got = t.gather_messages(msg, cap)
        if got is None:
            return done(None)
        t.sizes = [max(n - 1, 0) for n in t.sizes]
        self._payload_bytes(0)
        out: list[torch.Tensor | None] = [None] * self.size
        for w, m in zip(t.used, got):  # the messages as they arrived, no copy
            out[w] = m
        return done(out)

    def broadcast(self, msg: torch.Tensor, src: int, leg: int) -> torch.futures.Future:
        t, steps, late = self.t, self.t.steps, len(self.t.late)
        got, _ = t.broadcast_message(msg if self.rank == src else None, [], msg.numel())
        t.steps = steps  # the step counts the exchange (dqsgd.topology.step)
        self._payload_bytes(late)  # the stragglers' messages read after the last exchange
        return done(got)

    def wait(self, fut: torch.futures.Future) -> Any:
        return fut.value()

    def _payload_bytes(self, start: int) -> None:
        """The late messages from ``start`` on counted as payload bytes (their flag byte off), as the ledger counts."""
        self.t.late[start:] = [(seq, w, n - 1) for seq, w, n in self.t.late[start:]]


class BackupPSTransport(TorchPSTransport):
    """``ps`` over point-to-point messages; the server aggregates the first ``workers − backup`` arrivals."""

    arrival_order = True  # the trainer records :attr:`used`, :attr:`dropped` and :attr:`late` of each exchange

    def __init__(self, backup: int, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                 timeout: float | None = None):
        super().__init__(group, device, timeout)
        if not 1 <= backup < self.workers:
            raise ValueError(f"backup_workers must be in [1, W - 1] = [1, {self.workers - 1}], got {backup}")
        if self.backend != "gloo":
            raise ValueError(f"backup workers over processes run on gloo (CPU), not {self.backend}")
        self.backup = backup
        self.wait_s = (self.timeout or datetime.timedelta(seconds=60)).total_seconds()
        self.exchanges: int | None = None            # set by expect(): the run's number of exchanges
        self.used: list[int] = list(range(self.workers))
        self.dropped: list[int] = []
        self.sizes: list[int] = []                   # this exchange's payload bytes per worker (0: not used)
        self.late: list[tuple[int, int, int]] = []   # (exchange, worker, bytes) read and discarded
        self.received = [0] * self.workers           # payloads read per worker (used or late)
        self.dead: set[int] = set()
        self._cap = 0                                # the last exchange's payload cap (late payloads too; none owed before)
        self._heads: dict[int, tuple[_Waiting, torch.Tensor]] = {}  # server: the posted header receive per rank
        self._orphans: list[tuple[_Waiting, torch.Tensor]] = []
        self._arrival_group: ArrivalGroup | None = None
        self._pending: list[tuple[int, _Waiting, list[torch.Tensor]]] = []  # downlinks not yet delivered

    def exchange_groups(self) -> dict[int, ArrivalGroup]:
        """This rank's :class:`ArrivalGroup` (one for the run)."""
        if self._arrival_group is None:
            self._arrival_group = ArrivalGroup(self)
        return {self.rank: self._arrival_group}

    def expect(self, exchanges: int) -> None:
        """The run has ``exchanges`` exchanges: after the last, the server drains the stragglers."""
        self.exchanges = exchanges

    # --- numbers stay local (see the module docstring) --------------------------------------------
    def mean_loss(self, local: Sequence[float]) -> float:
        return sum(local) / len(local)

    def max_reduce(self, local: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(local) != 1:
            raise ValueError(f"backup transport: rank {self.rank} computes one worker, got {len(local)} tensors")
        return local[0]

    # --- point to point -------------------------------------------------------------------------
    def _poll(self, work: Any, what: str, deadline: float, give_up: Any = None) -> bool:
        """Wait for ``work`` until ``deadline`` (monotonic); False if ``give_up()`` turns true first."""
        waiting = _Waiting([work], max(0.0, deadline - time.monotonic()))
        while not waiting.done.wait(_POLL_S):
            self._prune()
            if give_up is not None and give_up():
                return False
        if waiting.error is not None:
            raise TransportError(f"rank {self.rank}: {what} failed or timed out after {self.wait_s:.0f}s at exchange "
                                 f"{self.steps} (dead ranks: {sorted(self.dead) or 'none known'}) "
                                 f"[{str(waiting.error).splitlines()[0] if str(waiting.error) else ''}]") from waiting.error
        return True

    def _send(self, dst: int, head: torch.Tensor, body: torch.Tensor, tags: tuple[int, int]) -> list[Any]:
        return [dist.isend(head, dst, group=self.group, tag=tags[0]), dist.isend(body, dst, group=self.group, tag=tags[1])]

    def _prune(self) -> None:
        """Forget delivered downlinks; a failed one marks its rank dead (a killed process)."""
        for dst, waiting, _ in self._pending:
            if waiting.done.is_set() and waiting.error is not None:
                self.dead.add(dst)
        self._pending = [p for p in self._pending if not p[1].done.is_set()]

    # --- uplink ---------------------------------------------------------------------------------
    def gather_messages(self, msg: torch.Tensor, max_bytes: int) -> list[torch.Tensor] | None:
        """The server: the W − b first messages (``uint8``, this exchange's, in worker order; their
        workers :attr:`used`); a worker: None, once its ``msg`` is sent."""
        deadline = time.monotonic() + self.wait_s
        if not self.is_server:
            head = torch.tensor([self.steps, msg.numel()], dtype=torch.int64)
            for w in self._send(0, head, msg.contiguous(), (UP_HEAD, UP_DATA)):
                self._poll(w, "uplink send to the server (rank 0)", deadline)
            return None
        got = {0: msg}
        self.received[0] += 1
        self._cap = max_bytes
        self.late = []
        while len(got) < self.workers - self.backup:
            if self.workers - len(self.dead) < self.workers - self.backup:
                raise TransportError(f"rank 0: exchange {self.steps} needs {self.workers - self.backup} workers, "
                                     f"ranks {sorted(self.dead)} are dead")
            src, seq, data = self._receive(max_bytes, deadline)
            if seq == self.steps:
                got[src] = data
        self.used = sorted(got)
        self.dropped = [w for w in range(self.workers) if w not in got]
        self.sizes = [got[w].numel() if w in got else 0 for w in range(self.workers)]
        self._owes_downlink = True
        return [got[w] for w in self.used]

    def _receive(self, max_bytes: int, deadline: float, give_up: Any = None) -> tuple[int, int, torch.Tensor]:
        """The next uplink to arrive: (rank, exchange, payload); an earlier exchange's also goes to
        :attr:`late`. Every live worker has one header receive posted (a receive from *any* rank fails
        as a whole when one peer dies); the first to complete is the next arrival. A receive that fails
        or stays silent for ``timeout`` marks its rank dead. (-1, -1, an empty tensor) if ``give_up()`` turned true."""
        while True:
            self._post_heads()
            done = [(w.when, src) for src, (w, _) in self._heads.items() if w.done.is_set()]
            if done:
                src = min(done)[1]
                waiting, head = self._heads.pop(src)
                if waiting.error is None:
                    data = self._body(src, head, max_bytes, deadline)
                    if data is not None:
                        return src, int(head[0]), data
                self.dead.add(src)
                self._orphans.append((waiting, head))  # a receive that timed out may still be filled later
                continue
            self._prune()
            if give_up is not None and give_up():
                return -1, -1, torch.empty(0, dtype=torch.uint8)
            if not self._heads or time.monotonic() > deadline:
                raise TransportError(f"rank 0: no uplink arrived within {self.wait_s:.0f}s at exchange {self.steps} "
                                     f"(dead ranks: {sorted(self.dead) or 'none known'})")
            time.sleep(_POLL_S)

    def _post_heads(self) -> None:
        for src in range(1, self.workers):
            more = self.exchanges is None or self.received[src] < self.exchanges
            if src not in self.dead and src not in self._heads and more:
                head = torch.zeros(2, dtype=torch.int64)
                try:  # gloo refuses at once to post to a peer whose connection closed
                    work = dist.irecv(head, src, group=self.group, tag=UP_HEAD)
                except (RuntimeError, dist.DistError):
                    self.dead.add(src)
                    continue
                self._heads[src] = (_Waiting([work], self.wait_s), head)

    def _body(self, src: int, head: torch.Tensor, max_bytes: int, deadline: float) -> torch.Tensor | None:
        """The payload announced by ``head`` (exchange, size) from ``src``; None if ``src`` died meanwhile."""
        seq, size = (int(v) for v in head.tolist())
        if not 0 <= seq <= self.steps or self.received[src] != seq:
            raise ProtocolError(f"rank 0: rank {src} sent exchange {seq}, expected {self.received[src]} "
                                f"(the server is at {self.steps})")
        check_sizes([size], [max_bytes], f"rank 0: exchange {seq}: rank {src}")
        body = torch.empty(size, dtype=torch.uint8)
        try:
            work = dist.irecv(body, src, group=self.group, tag=UP_DATA)
        except (RuntimeError, dist.DistError):
            return None
        waiting = _Waiting([work], max(0.0, deadline - time.monotonic()))
        waiting.done.wait()
        if waiting.error is not None:
            self._orphans.append((waiting, body))
            return None
        self.received[src] += 1
        if seq < self.steps:
            self.late.append((seq, src, size))
        return body

    # --- downlink -------------------------------------------------------------------------------
    def broadcast_message(self, payload: torch.Tensor | None, ints: Sequence[int],
                          max_bytes: int) -> tuple[torch.Tensor, list[int]]:
        """A header (status, payload size, number of integers), then the payload followed by the
        integers (int64). A non-server rank's ``ints`` are placeholders: it receives the server's.
        ``max_bytes`` caps the announced payload (an error message: 64 KiB), refused before allocating."""
        if self.is_server:
            if payload is None:
                raise ValueError("ps transport: the server must provide the downlink payload")
            self._send_downlink(OK, payload, ints)
            self._owes_downlink = False
            self.steps += 1
            if self.exchanges is not None and self.steps >= self.exchanges:
                self._drain()
            return payload, [int(v) for v in ints]
        deadline = time.monotonic() + self.wait_s
        head = torch.zeros(3, dtype=torch.int64)
        self._poll(dist.irecv(head, 0, group=self.group, tag=DOWN_HEAD), "downlink header from rank 0", deadline)
        status, size, count = (int(v) for v in head.tolist())
        if status == OK and count != len(ints):
            raise ProtocolError(f"ps transport: rank {self.rank} expects {len(ints)} integers with the downlink, "
                                f"the server announced {count}")
        check_sizes([size], [max_bytes if status == OK else MESSAGE_CAP], f"rank {self.rank}: the server (rank 0)")
        body = torch.empty(size + 8 * (count if status == OK else 0), dtype=torch.uint8)
        self._poll(dist.irecv(body, 0, group=self.group, tag=DOWN_DATA), "downlink from rank 0", deadline)
        if status != OK:
            self._raise_remote(tensor_bytes(body, size).decode(errors="replace"))
        self.steps += 1
        return body[:size], body[size:].clone().view(torch.int64).tolist()

    def _send_downlink(self, status: int, payload: torch.Tensor, ints: Sequence[int]) -> None:
        head = torch.tensor([status, payload.numel(), len(ints)], dtype=torch.int64)
        tail = torch.tensor([int(v) for v in ints], dtype=torch.int64).view(torch.uint8)
        body = torch.cat([payload.reshape(-1), tail])
        self._prune()
        for dst in range(1, self.workers):
            if dst not in self.dead:
                try:
                    works = self._send(dst, head, body, (DOWN_HEAD, DOWN_DATA))
                except (RuntimeError, dist.DistError):  # its connection closed: a dead rank
                    self.dead.add(dst)
                    continue
                self._pending.append((dst, _Waiting(works, self.wait_s), [head, body]))

    def _fail_pending_downlink(self, msg: str) -> None:
        self._send_downlink(FAILED, bytes_tensor(msg.encode()[:MESSAGE_CAP]), ())

    def _raise_remote(self, msg: str) -> None:
        kind, _, text = msg.partition(": ")
        where = f"rank {self.rank}: the server (rank 0) stopped at step {self.steps}: "
        raise _REMOTE_TYPES.get(kind, TransportError)(where + (text if kind in _REMOTE_TYPES else msg))

    def _drain(self) -> None:
        """After the last exchange: read what the live workers still send (their late payloads), then
        wait until every downlink is delivered; a rank that dies or stays silent for ``timeout`` is left."""
        deadline = time.monotonic() + self.wait_s
        owed = lambda: [w for w in range(1, self.workers) if w not in self.dead and self.received[w] < self.steps]  # noqa: E731
        try:
            while owed():
                self._receive(self._cap, deadline, give_up=lambda: not owed())
            while self._pending and time.monotonic() < deadline:
                self._prune()
                time.sleep(_POLL_S)
        except TransportError:  # a straggler that never came back: its payloads were never sent
            pass
