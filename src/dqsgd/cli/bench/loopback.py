"""The loopback DDP hook of ``dqsgd bench gpu``: one rank of W of the DDP hook, in one process.

At world size 1 ``dqsgd.ddp.hook`` passes the gradient through (there is nothing to send), so no
single-GPU run shows its cost. :class:`LoopbackHook` is registered on a world-size-1 DDP model as
its comm hook, so DDP's own buckets, futures and overlap with backward are the real ones; for each
bucket it makes the hook's own exchange call (:class:`dqsgd.topology.exchange.Exchange`, on the
hook's :class:`~dqsgd.ddp.HookState` bucket states: the same protocol, policy, widths and deferred
checks) as rank 0 of W, over a :class:`LoopbackGroup`: a group in which only this rank exists and
every collective completes at once with what the W − 1 others would have sent synthesized:

1. uplink: rank 0 encodes all W shards of its bucket (as a real rank does) and receives from
   every rank a replica of its own payload for shard 0, so it decodes and averages W payloads of
   its shard (as a real rank does);
2. downlink: rank 0 encodes its own shard's downlink (1/W of the bucket, as a real rank does) and
   receives the other W − 1 shard servers' messages: each encoded once per bucket and downlink
   width from the bucket's gradient at the time (a real rank receives them over the wire; from
   then on they are stale but valid payloads, so the loopback's updates are timing, not training),
   and decodes all W into the bucket.

So the loopback spends what a rank spends, minus the wire and its waiting. Payload checks are
deferred on a device (each bucket's flag, read once per timing round by :meth:`LoopbackHook.check`);
dynamic widths follow the hook's policy feed (one step late on a device).
"""

# no "from __future__ import annotations": DDP checks the hook's annotations as objects
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from dqsgd.topology.group import DOWN, Turns, done, then

__all__ = ["LoopbackGroup", "LoopbackHook", "build_model", "loopback_hook"]

Peers = Callable[[int, torch.Tensor], "list[torch.Tensor] | None"]


class LoopbackGroup:
    """Rank ``rank`` of a group of ``size`` ranks of which only this one runs (a
    :class:`~dqsgd.topology.group.Group`): every collective completes at once. What the others send:
    ``peers(leg, t)`` for an all-gather (the ``size`` tensors in rank order; None: ``t`` from every
    rank); in an all-to-all every rank sends this one a replica of what this one sends itself; a
    max-reduce is this rank's tensor."""

    def __init__(self, size: int, rank: int = 0, device: torch.device | None = None, peers: Peers | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"loopback group: rank {rank} of {size} ranks")
        self.size, self.rank, self.peers = size, rank, peers
        self.device = device if device is not None else torch.device("cpu")
        self.turns = Turns()

    def all_gather(self, t: torch.Tensor, leg: int) -> torch.futures.Future:
        got = self.peers(leg, t) if self.peers is not None else None
        return done(got if got is not None else [t] * self.size)

    def all_to_all(self, send: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int],
                   leg: int) -> torch.futures.Future:
        mine = send.split(list(send_sizes))[self.rank]
        if any(n != mine.numel() for n in recv_sizes):
            raise ValueError(f"loopback group: receives {list(recv_sizes)} elements from its replicas, sends itself "
                             f"{mine.numel()}")
        return done(mine.repeat(self.size))

    def max_reduce(self, t: torch.Tensor, leg: int) -> torch.futures.Future:
        return done(t.clone())

    def wait(self, fut: torch.futures.Future) -> Any:
        return fut.wait()

    def sub(self, members: Sequence[int]) -> "LoopbackGroup":
        return LoopbackGroup(len(members), list(members).index(self.rank), self.device)


class _Servers:
    """The other shard servers' downlink messages of the bucket being exchanged (module docstring, 2):
    the ``peers`` of the loopback group, answering the downlink leg's all-gathers (the coded
    downlink's lengths, int64, then the messages)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.cache: dict[int, tuple[Any, dict[tuple[int, int], list[torch.Tensor]]]] = {}  # index -> (proto, ...)
        self.now: tuple[int, Any, torch.Tensor, int] | None = None  # (bucket index, its state, gradient, width)

    def __call__(self, leg: int, t: torch.Tensor) -> list[torch.Tensor] | None:
        if leg != DOWN or self.now is None:
            return None
        msgs = self._messages(t.numel() if t.dtype == torch.uint8 else 0)
        if t.dtype == torch.int64:  # a coded downlink's lengths
            return [t if j == self.rank else torch.tensor([m.numel()], dtype=t.dtype, device=t.device)
                    for j, m in enumerate(msgs)]
        return [t if j == self.rank else m for j, m in enumerate(msgs)]

    def _messages(self, size: int) -> list[torch.Tensor]:
        """Every shard's message (its payload, zero padded to ``size`` − 1 bytes for a fixed downlink,
        then the status byte 0), built once per bucket protocol (DDP's rebuilt buckets get new ones),
        width and size."""
        index, b, flat, dbits = self.now  # type: ignore[misc]
        P = b.proto
        if index not in self.cache or self.cache[index][0] is not P:
            self.cache[index] = (P, {})
        got, key = self.cache[index][1], (dbits, 0 if P.coded_down else size)
        if key not in got:
            x = flat.detach().reshape(-1).to(torch.float32)
            zero = torch.zeros(1, dtype=torch.uint8, device=x.device)
            got[key] = [zero if j == self.rank else  # this rank's own is the one it encodes each step
                        torch.cat([P.encode_down(j, x[lo:hi], b.step - 1, None if P.coded_down else size - 1, dbits),
                                   zero]) for j, (lo, hi) in enumerate(P.bounds)]
        return got[key]


class LoopbackHook:
    """The state of :func:`loopback_hook` (``model.register_comm_hook(h, loopback_hook)``): rank 0 of
    ``world`` ranks of the DDP hook with ``method`` (a method name: ``qsgd-4bit``, ``dqsgd``), its
    default topology and downlink (module docstring)."""

    def __init__(self, method: str, world: int, total_steps: int = 1000, seed: int = 0) -> None:
        from dqsgd.ddp import HookState

        if world < 2:
            raise ValueError(f"the loopback plays W >= 2 ranks, got {world}")
        self.state = HookState(method, None, seed=seed, total_steps=total_steps)
        self.config, self.world, self.rank = self.state.config, world, 0
        self.servers = _Servers(self.rank)
        self.groups: dict[torch.device, LoopbackGroup] = {}
        self.buckets: dict[int, Any] = {}  # index -> its BucketState (the hook's)

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The hook's exchange of one bucket; returns the (completed) future DDP waits for."""
        from dqsgd.topology.exchange import Exchange

        grad = bucket.buffer()
        b = self.buckets[bucket.index()] = self.state.bucket(
            bucket.index(), grad, [p.numel() for p in bucket.parameters()], self.rank, self.world)
        b.prepare(grad.device)  # the policy fed what waited (the hook's lag)
        group = self.groups.setdefault(grad.device, LoopbackGroup(self.world, self.rank, grad.device, self.servers))
        self.servers.now = (bucket.index(), b, grad, b.proto.down_width(b.policy))
        out = Exchange(b).start({self.rank: (grad, group, b)})[self.rank]
        return then(out, lambda o: o.update.to(grad.dtype).reshape(grad.shape))

    def check(self) -> None:
        """Raise if any deferred payload check failed (call after a synchronize)."""
        if any(b.bad is not None and bool(b.bad) for b in self.buckets.values()):
            raise RuntimeError("loopback: a payload failed its checks (crc, padding or code range)")


def loopback_hook(state: LoopbackHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: :meth:`LoopbackHook.run` of ``state``."""
    return state.run(bucket)


# ----------------------------------------------------------------------------------- DDP timing

HOOKS = ("none", "fp16", "powersgd-1", "qsgd-4bit", "dqsgd")


def build_model(name: str, width: int = 1024, layers: int = 8) -> tuple[torch.nn.Module, tuple[int, ...], bool]:
    """(model, input shape per sample, classifier?): ``resnet18`` at 3×32×32, or ``transformer``: a stack
    of ``layers`` encoder blocks of width ``width`` (1024 × 8: 100.8M parameters), sequences of 128."""
    torch.manual_seed(0)
    if name == "resnet18":
        from dqsgd.models import DatasetInfo, build_model as build

        return build("resnet18", DatasetInfo(num_classes=10, input_shape=(3, 32, 32))), (3, 32, 32), True
    if name in ("transformer", "transformer-small"):  # the small one: 2 blocks of width 64, for smoke tests
        width, layers = (width, layers) if name == "transformer" else (64, 2)
        block = torch.nn.TransformerEncoderLayer(width, max(width // 64, 1), 4 * width, dropout=0.0, batch_first=True)
        return torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False), (128, width), False
    raise ValueError(f"unknown model {name!r}: resnet18 or transformer")
