"""torch.distributed transports: one worker per process (``local_workers == [r]``), one per topology.

A step runs over the transport's :meth:`~_TorchTransport.exchange_groups`: this rank's
:class:`~dqsgd.topology.group.TorchGroup` (two process groups of its own, one per leg, with the
transport's timeout), on which the topology's exchange issues its collectives
(:mod:`dqsgd.topology.exchange`, :mod:`dqsgd.topology.server`, :mod:`dqsgd.topology.sketched`):

* :class:`TorchPSTransport` — rank 0 is the server *and* worker 0 (DQSGD Algorithm 2): the exchange
  gathers the payloads on rank 0, which aggregates, runs the bit policy and broadcasts the update
  with B_{n+1} and its refusal, if any, in one message;
* :class:`TorchAllGatherTransport` — no server: every rank gathers every payload and runs the same
  aggregation and policy; :meth:`TorchAllGatherTransport.agree` checks, with one tiny all-reduce,
  that the ranks really agree (same width, same update CRC-32);
* :class:`TorchShardedTransport` — every rank is the server of one shard; its :meth:`exchange`
  (the uplink all-to-all of byte payloads, sizes first) also serves FSDP's reduce-scatter.

Besides the groups a transport offers a few small collectives of numbers (``max_reduce``,
``mean_loss``, ``all_gather_ints``) and a variable-length byte all-gather (:meth:`all_gather_bytes`):
the sizes go first (an int64 all-gather, so every rank knows the longest, each checked against its
cap before anything is allocated), then the payloads padded to that length. On gloo the tensors stay
on the CPU; on NCCL they are moved to ``device`` (the rank's GPU) — the same code.

Failures. Every collective runs under a timeout (the transport's ``timeout``, else the one given to
``init_process_group``), so nothing waits forever; a failed collective (peer crashed, was killed or timed out) raises
:class:`TransportError` naming this rank, the operation and, when the failing rank left one, its
own error message (an error board in the rendezvous store): run a trainer inside
``with transport.guard(): ...`` to leave it there. A payload an aggregating rank refuses reaches
every rank inside the exchange's own downlink (its status byte), with its type and text.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import zlib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from dqsgd.core.ranges import check_timeout
from dqsgd.topology.agreement import RankDisagreement
from dqsgd.topology.group import TorchGroup
from dqsgd.topology.refusal import check_sizes
from dqsgd.topology.registry import topology_of
from dqsgd.topology.payloads import bytes_tensor, tensor_bytes

__all__ = ["RankDisagreement", "TorchAllGatherTransport", "TorchPSTransport", "TorchShardedTransport", "TransportError",
           "make_transport"]

_ERROR_KEY = "dqsgd/error/{}"
_BOARD_TIMEOUT = datetime.timedelta(seconds=2)  # the error board is best effort: a short wait, not a collective's


class TransportError(RuntimeError):
    """A collective failed: a peer process died, stopped, or did not answer within the timeout."""


def _backend_reason(err: BaseException) -> str:
    """The useful part of a gloo/NCCL error ('Connection closed by peer [127.0.0.1]:4711')."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically")[0].rstrip(".")


class _TorchTransport:
    """What every topology shares: the exchange's group, sizes-first byte all-gather, max-reduce,
    timeouts, error reporting."""

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
        self.steps: int | None = 0     # completed steps, for error messages (None: not counted here)
        self._owes_downlink = False    # backup workers' server: gathered this step's payloads, not yet broadcast
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
        after = "" if self.steps is None else f" after {self.steps} completed steps"
        return f"rank {self.rank}: {op} failed{after}: {said} [{_backend_reason(err)}]"

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


def make_transport(topology: str, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                   timeout: float | None = None) -> TorchPSTransport | TorchAllGatherTransport | TorchShardedTransport:
    """``"ps"``, ``"allgather"`` or ``"sharded"`` over ``group`` (default: the whole world); ``timeout``
    per collective in seconds (default: the one given to ``init_process_group``)."""
    kind = topology_of(topology)  # what the topology does, not its name: a topology registered later too
    cls = TorchPSTransport if kind.server else TorchShardedTransport if kind.sharded else TorchAllGatherTransport
    return cls(group, device, timeout)
