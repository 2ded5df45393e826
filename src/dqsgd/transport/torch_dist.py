"""torch.distributed transports: a parameter server (DQSGD Algorithm 2) and a peer all-gather.

One worker per process: rank r computes worker r's gradient (``local_workers == [r]``).

* :class:`TorchPSTransport` — rank 0 is the server *and* worker 0. Every rank sends its payload to
  rank 0 (``gather``); rank 0 decodes, averages, runs the bit policy and sends the update and
  B_{n+1} (a few integers beside the payload) back to all ranks (``broadcast``), exactly
  Algorithm 2, lines 6–7 and 9–13.
* :class:`TorchAllGatherTransport` — no server: every rank receives every payload (``all_gather``),
  decodes them in worker order and runs the same policy on the same bytes, so all ranks reach the
  same B_{n+1} without a downlink (``is_server`` is True everywhere). ``broadcast`` only checks,
  with one tiny all-reduce, that the ranks really agree (same integers, same downlink CRC-32).
* :class:`TorchShardedTransport` — every rank is the server of one shard (``dqsgd.core.sharding``):
  ``exchange`` is the uplink all-to-all (rank j receives every worker's payload for shard j),
  ``share`` the downlink all-gather of the W averaged, re-quantized shards.

Received sizes are capped: every rank checks every announced size against the largest payload the
method can produce (``max_bytes``) and raises :class:`~dqsgd.codecs.PayloadError` before it
allocates a receive buffer. All ranks see the same sizes, so all of them refuse together.

Variable-length byte payloads cross the wire as uint8 tensors: the sizes go first (an int64
all-gather, so every rank knows the longest), then the payloads padded to that length. On gloo the
tensors stay on the CPU; on NCCL they are moved to ``device`` (the rank's GPU) — the same code.

Failures. Every collective runs under a timeout (the transport's ``timeout``, else the one given to
``init_process_group``), so nothing waits forever; a failed collective (peer crashed, was killed or timed out) raises
:class:`TransportError` naming this rank, the operation and, when the failing rank left one, its
own error message (an error board in the rendezvous store). Errors found by the server after a
gather (a malformed payload: :class:`~dqsgd.codecs.PayloadError`, a wrong message:
:class:`~dqsgd.method.pipeline.ProtocolError`, both naming the worker) are sent to the waiting ranks in
the downlink header by :meth:`abort`, so they stop at once with the same error type and text rather
than at the timeout. Run a trainer inside ``with transport.guard(): ...`` to get this.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import zlib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from dqsgd.codecs import PayloadError
from dqsgd.core.ranges import check_timeout
from dqsgd.method.pipeline import ProtocolError
from dqsgd.topology.agreement import RankDisagreement
from dqsgd.topology.group import TorchGroup
from dqsgd.topology.limits import check_sizes
from dqsgd.topology.registry import topology_of
from dqsgd.topology.payloads import bytes_tensor, tensor_bytes

__all__ = ["RankDisagreement", "TorchAllGatherTransport", "TorchPSTransport", "TorchShardedTransport", "TransportError",
           "make_transport"]

OK, FAILED = 0, 1
_ERROR_KEY = "dqsgd/error/{}"
MESSAGE_CAP = 1 << 16  # the most bytes of an error message in a downlink header
_BOARD_TIMEOUT = datetime.timedelta(seconds=2)  # the error board is best effort: a short wait, not a collective's
# Errors re-raised with their own type on the ranks that learn of them from the server.
_REMOTE_TYPES: dict[str, type[Exception]] = {"PayloadError": PayloadError, "ProtocolError": ProtocolError}


class TransportError(RuntimeError):
    """A collective failed: a peer process died, stopped, or did not answer within the timeout."""


def _backend_reason(err: BaseException) -> str:
    """The useful part of a gloo/NCCL error ('Connection closed by peer [127.0.0.1]:4711')."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically")[0].rstrip(".")


class _TorchTransport:
    """What both topologies share: sizes-first byte exchange, max-reduce, timeouts, error reporting."""

    topology = "?"

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                 timeout: float | None = None):
        check_timeout("timeout", timeout)  # None: the process group's
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first "
                               "(dqsgd.cli.launch does it for `dqsgd train --transport torch`)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.workers = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        self.steps = 0                 # completed steps (downlinks delivered), for error messages
        self._owes_downlink = False    # server: gathered this step's payloads, not yet broadcast
        self._exchange_group: TorchGroup | None = None  # the step's exchange's group (exchange_groups)

    # --- the Transport protocol -----------------------------------------------------------------
    @property
    def local_workers(self) -> Sequence[int]:
        return (self.rank,)

    def max_reduce(self, local: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(local) != 1:
            raise ValueError(f"{self.topology} transport: rank {self.rank} computes one worker, got {len(local)} tensors")
        x = local[0].detach().to(self.device).clone()
        self._collective("max_reduce", dist.all_reduce, x, op=dist.ReduceOp.MAX)
        return x.to(local[0].device)

    def mean_loss(self, local: Sequence[float]) -> float:
        """One tiny all-reduce, so that every rank logs the same mean over all W workers' losses."""
        t = torch.tensor([sum(local), len(local)], dtype=torch.float64, device=self.device)
        self._collective("mean_loss", dist.all_reduce, t, op=dist.ReduceOp.SUM)
        total, count = t.tolist()
        return total / count

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.device)
        bufs = [torch.zeros_like(mine) for _ in range(self.workers)]
        self._collective("all_gather_ints", dist.all_gather, bufs, mine)
        return [[int(v) for v in b.tolist()] for b in bufs]

    def exchange_groups(self) -> dict[int, TorchGroup]:
        """This rank over two groups of its own with the transport's timeout (made at the first step,
        on every rank); a failed collective raises :class:`TransportError` naming the rank and the step."""
        if self._exchange_group is None:
            self._exchange_group = TorchGroup(self.group, None if self.timeout is None else self.timeout.total_seconds(),
                                              lambda e: TransportError(self._explain("exchange", e)), self.device)
        return {self.rank: self._exchange_group}

    # --- byte exchange --------------------------------------------------------------------------
    def _one_payload(self, payloads: Sequence[bytes]) -> bytes:
        if len(payloads) != 1:
            raise ValueError(f"{self.topology} transport: rank {self.rank} sends one payload, got {len(payloads)}")
        return payloads[0]

    def _size_rows(self, row: Sequence[int], op: str, caps: Sequence[int], sender: str = "rank {w}") -> list[list[int]]:
        """Every rank's ``row`` of sizes (an int64 all-gather), each entry checked against ``caps``;
        ``sender`` names rank w in a refusal."""
        mine = torch.tensor([int(v) for v in row], dtype=torch.int64, device=self.device)
        rows = [torch.zeros_like(mine) for _ in range(self.workers)]
        self._collective(f"{op} (size exchange)", dist.all_gather, rows, mine)
        out = [[int(v) for v in r.tolist()] for r in rows]
        for w, r in enumerate(out):
            check_sizes(r, caps, f"rank {self.rank}: {op}: " + sender.format(w=w))
        return out

    def _all_sizes(self, n: int, op: str, max_bytes: int, sender: str = "rank {w}") -> list[int]:
        return [r[0] for r in self._size_rows([n], op, [max_bytes], sender)]

    def all_gather_bytes(self, payload: bytes, op: str, max_bytes: int, sender: str = "rank {w}") -> list[bytes]:
        """Every rank's payload, in rank order, on every rank."""
        sizes = self._all_sizes(len(payload), op, max_bytes, sender)
        width = max(sizes)
        mine = bytes_tensor(payload, self.device, width)
        bufs = [torch.empty_like(mine) for _ in range(self.workers)]
        self._collective(op, dist.all_gather, bufs, mine)
        return [tensor_bytes(b, n) for b, n in zip(bufs, sizes)]

    # --- failures -------------------------------------------------------------------------------
    def _collective(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        """``fn(*args, **kw)`` on this group, waited for at most ``timeout`` (else the group's own)."""
        try:
            work = fn(*args, group=self.group, async_op=True, **kw)
            if self.timeout is None:
                work.wait()
            else:
                work.wait(timeout=self.timeout)
        except (RuntimeError, dist.DistError) as e:  # gloo/NCCL errors: peer closed, timeout, reset
            raise TransportError(self._explain(what, e)) from e

    def _explain(self, op: str, err: BaseException) -> str:
        peers = [(r, m) for r, m in self._reported_errors() if not m.startswith(TransportError.__name__)]
        said = "; ".join(f"rank {r} reported {m}" for r, m in peers) if peers else (
            "a peer process crashed, was killed or did not answer within the timeout")
        return f"rank {self.rank}: {op} failed after {self.steps} completed steps: {said} [{_backend_reason(err)}]"

    def _store(self) -> dist.Store | None:
        """The rendezvous store: it outlives a dead worker when torchrun's agent or our launcher hosts it."""
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # private API, or no default group: the error board is best effort
            return None

    def _reported_errors(self) -> list[tuple[int, str]]:
        store = self._store()
        if store is None:
            return []
        found = []
        try:
            store.set_timeout(_BOARD_TIMEOUT)
            for r in range(self.workers):
                key = _ERROR_KEY.format(r)
                if r != self.rank and store.check([key]):
                    found.append((r, store.get(key).decode(errors="replace")))
        except Exception:  # the store's host may be gone too: the board is best effort
            pass
        return found

    def abort(self, exc: BaseException) -> None:
        """Tell the other ranks that this one stops because of ``exc`` (best effort, never raises).

        The message goes on the error board in the store; if this is the PS server and the other
        ranks are waiting for this step's downlink, it also goes to them in the downlink header.
        """
        msg = f"{type(exc).__name__}: {exc}"
        store = self._store()
        if store is not None:
            with contextlib.suppress(Exception):
                store.set_timeout(_BOARD_TIMEOUT)
                store.set(_ERROR_KEY.format(self.rank), msg)
        if self._owes_downlink and not isinstance(exc, TransportError):
            self._owes_downlink = False
            with contextlib.suppress(Exception):
                self._fail_pending_downlink(msg)

    @contextlib.contextmanager
    def guard(self) -> Iterator[_TorchTransport]:
        """``with transport.guard(): run(...)`` — on any exception, :meth:`abort` before re-raising."""
        try:
            yield self
        except BaseException as e:
            self.abort(e)
            raise

    def _fail_pending_downlink(self, msg: str) -> None:
        """Only the PS server ever owes a downlink (``_owes_downlink``); peers aggregate themselves."""


class TorchPSTransport(_TorchTransport):
    """Parameter server (Algorithm 2): rank 0 aggregates and broadcasts the update (and the caller's
    integers beside it: B_{n+1})."""

    topology = "ps"

    @property
    def is_server(self) -> bool:
        return self.rank == 0

    def gather(self, payloads: Sequence[bytes], max_bytes: int) -> list[bytes] | None:
        payload = self._one_payload(payloads)
        sizes = self._all_sizes(len(payload), "gather", max_bytes)
        width = max(sizes)
        mine = bytes_tensor(payload, self.device, width)
        bufs = [torch.empty_like(mine) for _ in range(self.workers)] if self.is_server else None
        self._collective("gather", dist.gather, mine, bufs, dst=0)
        if bufs is None:
            return None
        self._owes_downlink = True
        return [tensor_bytes(b, n) for b, n in zip(bufs, sizes)]

    def broadcast(self, payload: bytes | None, ints: Sequence[int],
                  max_bytes: int) -> tuple[bytes, list[int]]:
        """A header (status, payload size, number of integers), then the payload followed by the
        integers (int64). A non-server rank's ``ints`` are placeholders: it receives the server's.
        ``max_bytes`` caps the announced payload (an error message: 64 KiB), refused before allocating."""
        if self.is_server:
            if payload is None:
                raise ValueError("ps transport: the server must provide the downlink payload")
            self._send_downlink(OK, payload, ints)
            self._owes_downlink = False
            self.steps += 1
            return payload, [int(v) for v in ints]
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        self._collective("broadcast (header)", dist.broadcast, header, src=0)
        status, size, count = (int(v) for v in header.tolist())
        if status == OK and count != len(ints):
            raise ProtocolError(f"ps transport: rank {self.rank} expects {len(ints)} integers with the downlink, "
                                f"the server announced {count}")
        check_sizes([size], [max_bytes if status == OK else MESSAGE_CAP], f"rank {self.rank}: the server (rank 0)")
        count = count if status == OK else 0
        body = torch.empty(size + 8 * count, dtype=torch.uint8, device=self.device)
        self._collective("broadcast", dist.broadcast, body, src=0)
        if status != OK:
            self._raise_remote(tensor_bytes(body, size).decode(errors="replace"))
        self.steps += 1
        return tensor_bytes(body, size), body[size:].cpu().clone().view(torch.int64).tolist()

    def _fail_pending_downlink(self, msg: str) -> None:
        self._send_downlink(FAILED, msg.encode()[:MESSAGE_CAP], ())

    def _send_downlink(self, status: int, payload: bytes, ints: Sequence[int]) -> None:
        header = torch.tensor([status, len(payload), len(ints)], dtype=torch.int64, device=self.device)
        tail = torch.tensor([int(v) for v in ints], dtype=torch.int64).view(torch.uint8)
        body = torch.cat([torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else
                          torch.zeros(0, dtype=torch.uint8), tail]).to(self.device)
        self._collective("broadcast (header)", dist.broadcast, header, src=0)
        self._collective("broadcast", dist.broadcast, body, src=0)

    def _raise_remote(self, msg: str) -> None:
        kind, _, text = msg.partition(": ")
        where = f"rank {self.rank}: the server (rank 0) stopped at step {self.steps}: "
        raise _REMOTE_TYPES.get(kind, TransportError)(where + (text if kind in _REMOTE_TYPES else msg))


class TorchAllGatherTransport(_TorchTransport):
    """Peer topology: every rank gathers all payloads and runs the same aggregation and policy."""

    topology = "allgather"

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                 timeout: float | None = None, check_agreement: bool = True):
        super().__init__(group, device, timeout)
        self.check_agreement = check_agreement

    @property
    def is_server(self) -> bool:
        return True

    def gather(self, payloads: Sequence[bytes], max_bytes: int) -> list[bytes]:
        return self.all_gather_bytes(self._one_payload(payloads), "gather", max_bytes)

    def broadcast(self, payload: bytes | None, ints: Sequence[int],
                  max_bytes: int) -> tuple[bytes, list[int]]:
        if payload is None:
            raise ValueError("allgather transport: every rank must provide its downlink payload")
        self.agree(payload, ints)
        self.steps += 1
        return payload, [int(v) for v in ints]

    def agree(self, payload: bytes, ints: Sequence[int]) -> None:
        """With ``check_agreement``: max(x) == -max(-x) on every rank iff all ranks hold the same
        (integers, CRC-32 of the update, its length); the trainer's integer is B_{n+1}."""
        if not self.check_agreement:
            return
        mine = [*(int(v) for v in ints), zlib.crc32(payload), len(payload)]
        t = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=self.device)
        self._collective("agreement check", dist.all_reduce, t, op=dist.ReduceOp.MAX)
        hi, lo = t[: len(mine)].tolist(), [-v for v in t[len(mine):].tolist()]
        if hi != lo:
            raise RankDisagreement(
                f"rank {self.rank}: after step {self.steps} the ranks disagree on (B_n+1, update CRC-32, bytes): "
                f"mine {tuple(mine)}, range {tuple(lo)}..{tuple(hi)}; the peer topology needs bitwise-deterministic "
                f"decoding on every rank (use the ps topology on mixed hardware)")


class TorchShardedTransport(_TorchTransport):
    """Every rank serves shard ``rank``: an all-to-all of payloads up, an all-gather of shards down.

    The sizes go first (one int64 all-gather of each rank's W sizes, so every rank knows the whole
    W×W matrix: the ledger's per-rank bytes and the all-to-all's split sizes); the payloads then
    travel with their exact sizes (``all_to_all_single``), no padding. Ranks hold bitwise the same
    downlink shards afterwards, so they all derive the same update and B_{n+1} without a check.
    """

    topology = "sharded"

    @property
    def is_server(self) -> bool:
        return True

    def exchange(self, rows: Sequence[Sequence[bytes]],
                 max_bytes: Sequence[int]) -> tuple[dict[int, list[bytes]], list[list[int]]]:
        if len(rows) != 1 or len(rows[0]) != self.workers:
            raise ValueError(f"sharded transport: rank {self.rank} sends one row of {self.workers} shard payloads")
        row = rows[0]
        sizes = self._size_rows([len(p) for p in row], "exchange", max_bytes)
        incoming = [sizes[w][self.rank] for w in range(self.workers)]
        send = torch.frombuffer(bytearray(b"".join(row)), dtype=torch.uint8) if sum(sizes[self.rank]) else \
            torch.zeros(0, dtype=torch.uint8)
        recv = torch.empty(sum(incoming), dtype=torch.uint8, device=self.device)
        self._collective("exchange", dist.all_to_all_single, recv, send.to(self.device), incoming, sizes[self.rank])
        data, out, at = recv.cpu().numpy().tobytes(), [], 0
        for n in incoming:
            out.append(data[at : at + n])
            at += n
        return {self.rank: out}, sizes

    def share(self, shards: dict[int, bytes], max_bytes: int) -> list[bytes]:
        if set(shards) != {self.rank}:
            raise ValueError(f"sharded transport: rank {self.rank} shares shard {self.rank} only, got {sorted(shards)}")
        out = self.all_gather_bytes(shards[self.rank], "share", max_bytes, "rank {w} (the server of shard {w})")
        self.steps += 1
        return out


def make_transport(topology: str, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                   timeout: float | None = None) -> TorchPSTransport | TorchAllGatherTransport | TorchShardedTransport:
    """``"ps"``, ``"allgather"`` or ``"sharded"`` over ``group`` (default: the whole world); ``timeout``
    per collective in seconds (default: the one given to ``init_process_group``)."""
    kind = topology_of(topology)  # what the topology does, not its name: a topology registered later too
    cls = TorchPSTransport if kind.server else TorchShardedTransport if kind.sharded else TorchAllGatherTransport
    return cls(group, device, timeout)
