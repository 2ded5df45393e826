"""A topology that exists only in the tests: two-level, sharded inside groups of GROUP ranks, then the
groups' updates averaged across the groups. Adding it is the class below and one registry line
(:func:`register`); the trainer's step, the simulation and the DDP hook then all run it."""

from __future__ import annotations

from typing import Any

import torch

from dqsgd.fsdp.hsdp import ShardBucket  # what the hook reads of a DDP GradBucket
from dqsgd.topology.registry import REGISTRY, Legs, Sharded

GROUP, NAME, SEED, N, STEPS = 2, "hier2", 5, 1001, 4


class Hierarchical(Sharded):
    """``hier2``: the sharded exchange inside each group of GROUP consecutive ranks (shard j of a bucket
    served by the group's j-th rank), then the mean of the groups' updates across the groups."""

    name = NAME

    def shards(self, workers: int) -> int:
        return min(GROUP, workers)

    def split(self, group: Any) -> tuple[Any, Any]:
        size = min(GROUP, group.size)
        first = group.rank // size * size
        across = range(group.rank % size, group.size, size)  # the ranks that serve the same shard
        return group.sub(range(first, first + size)), group.sub(across) if group.size > size else None


    def legs(self, up: Any, down: Any, rank: int) -> Legs:
        """The sharded exchange inside rank ``rank``'s group (``up``: its rows, or every rank's in group
        order; ``down``'s first len(up[0]) entries: its shards'), then the all-gather of the groups'
        updates: ``down``'s further entries, each other group's update, which this rank receives and
        sends its own of, in the downlink phase."""
        size = len(up[0])  # the group's ranks, each serving one shard
        first, shards = rank - rank % size, down[:size]
        inner, across = super().legs(up[first : first + size], shards, rank % size), sum(down[size:])
        return inner._replace(down_sent=inner.down_sent + across, down_received=inner.down_received + across)


def register() -> None:
    REGISTRY.setdefault(NAME, Hierarchical())


def grad(worker: int, step: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(1000 * worker + step))


def sharded_step(method: str, workers: int, topology: str = NAME) -> tuple[Any, Any]:
    """The trainer's step object of ``method`` for the topology, with the hook's kernel and downlink."""
    from dqsgd.ddp import HookState
    from dqsgd.method.config import method_config
    from dqsgd.method.pipeline import Method
    from dqsgd.topology.bucket import replace_kernel
    from dqsgd.topology.step import ExchangeStep

    hs = HookState(method, None, seed=SEED, timeout=60.0, total_steps=STEPS, topology=topology)
    m = Method(replace_kernel(method_config(method), "fused"), N, STEPS, [N])
    return ExchangeStep(m, [N], workers, SEED, hs.downlink, topology), hs


def run_steps(step: Any, t: Any, workers: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """STEPS steps of ``step`` over transport ``t`` for the local ``workers``: the updates and widths."""
    from dqsgd.topology.bucket import worker_generator

    state, updates, bits = step.method.init_state(step.workers, step.policy), [], []
    for s in range(STEPS):
        bits.append(state.bits)
        out = step.run(t, {w: grad(w, s) for w in workers}, state, s, {w: worker_generator(SEED, w) for w in workers})
        updates.append(out.update)
        state = out.state
    return updates, bits


def hier_case(rank: int, world: int, methods: list[str]) -> dict[str, Any]:
    """Each method: STEPS steps of the trainer's step over gloo, and STEPS buckets of the DDP hook."""
    import dqsgd.ddp
    from dqsgd.transport import make_transport

    register()
    out: dict[str, Any] = {}
    for method in methods:
        step, hs = sharded_step(method, world)
        trainer, bits = run_steps(step, make_transport(NAME, timeout=60.0), [rank])
        hook, hook_bits = [], []
        for s in range(STEPS):
            hook.append(dqsgd.ddp.hook(hs, ShardBucket(0, grad(rank, s), [N], last=True)).wait().clone())
            hook_bits.append(hs.current_bits()[0])
        out[method] = {"trainer": trainer, "bits": bits, "hook": hook, "hook_bits": hook_bits}
    return out


class Counting:
    """A group that counts the bytes this rank sends and receives in each leg's collectives (a rank's
    own piece excluded), on a :class:`dqsgd.topology.group.Group` that moves them; its sub-groups
    count into the same book."""

    def __init__(self, group: Any, book: dict[int, list[int]]):
        self.g, self.book, self._subs = group, book, {}  # type: ignore[var-annotated]
        self.rank, self.size, self.turns, self.device = group.rank, group.size, group.turns, group.device

    def _add(self, leg: int, sent: int, received: int) -> None:
        self.book[leg][0] += sent
        self.book[leg][1] += received

    def all_gather(self, t: torch.Tensor, leg: int) -> Any:
        n = t.numel() * t.element_size()
        self._add(leg, (self.size - 1) * n, (self.size - 1) * n)  # equal shapes everywhere
        return self.g.all_gather(t, leg)

    def all_to_all(self, send: torch.Tensor, send_sizes: Any, recv_sizes: Any, leg: int) -> Any:
        item, r = send.element_size(), self.rank
        self._add(leg, (sum(send_sizes) - send_sizes[r]) * item, (sum(recv_sizes) - recv_sizes[r]) * item)
        return self.g.all_to_all(send, send_sizes, recv_sizes, leg)

    def max_reduce(self, t: torch.Tensor, leg: int) -> Any:
        n = t.numel() * t.element_size()
        self._add(leg, (self.size - 1) * n, (self.size - 1) * n)
        return self.g.max_reduce(t, leg)

    def wait(self, fut: Any) -> Any:
        return self.g.wait(fut)

    def sub(self, members: Any) -> Counting:
        key = tuple(members)
        if key not in self._subs:
            self._subs[key] = Counting(self.g.sub(key), self.book)
        return self._subs[key]
