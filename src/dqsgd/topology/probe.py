"""The DDP hook's link policy on a measured link: what it measures at its first call, before any bucket
is in flight (docs/ddp-hook.md, "The default is the stated budget; the link policy is opt-in").

The link (:func:`~dqsgd.policies.linktime.measure_link`), the codec against its model
(:func:`~dqsgd.policies.linktime.codec_slowdown`), and the first bucket's step as the hook runs it:
its compressed exchange (encode, the collectives, decode) on a throwaway bucket state at a step between
the policy's re-evaluations (what most steps of a run cost), and its plain all-reduce, both waited for,
every rank at once (their contention for the cores is in the figures), the least of ``repeats`` each, max-reduced over the ranks. The policy prices
what the model misses of them as a cost per coordinate (:meth:`dqsgd.policies.link.LinkPolicy.measured`).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from dqsgd.topology.group import UP

if TYPE_CHECKING:
    from dqsgd.topology.group import TorchGroup

__all__ = ["PROBE_NUMEL", "measure_hook"]

PROBE_NUMEL = 1 << 18  # the first bucket's steps are timed on at most this many of its coordinates (a prefix)


def measure_hook(state: Any, group: TorchGroup, bucket: Any, repeats: int = 2) -> tuple[float, ...]:
    """(Mbit/s, latency s, k, plain ns, ((coding, compressed ns), ...) per coordinate) for ``state`` (a
    :class:`dqsgd.ddp.HookState` of the link policy) at its first call on ``bucket`` (a GradBucket);
    every rank holds the same figures. The compressed step runs at the policy's first widths (its start
    width, the hook's downlink) in each coding the policy prices: the figures it calibrates its model with.
    Both steps run on a prefix of at most :data:`PROBE_NUMEL` coordinates (DDP's first bucket holds the
    whole model until it rebuilds its buckets; timing it whole cost seconds at 100 Mbit/s) and are scaled
    to the bucket: the model's per-step latency once, the rest in proportion to the coordinates."""
    from dqsgd.policies.linktime import agree, codec_slowdown, max_over, measure_link
    from dqsgd.topology.bucket import worker_generator
    from dqsgd.topology.exchange import Exchange
    from dqsgd.topology.state import BucketState

    mbit, latency = measure_link(group)
    state.link = (mbit, latency, codec_slowdown(group))  # what the throwaway bucket's policy is priced on
    n, world = bucket.buffer().numel(), group.size
    if n < world:  # no compressed step to time: the model as it is
        return state.link
    m = min(n, PROBE_NUMEL)
    grad = bucket.buffer().detach()[:m]
    sizes = [p.numel() for p in bucket.parameters()]
    sizes = sizes if sum(sizes) == n and m == n else [m]
    proto = state.protocol(bucket.index(), m, sizes, world, grad.dtype)
    b = BucketState(numel=m, proto=proto, policy=proto.policy.init(),
                    generator=worker_generator(state.seed, group.rank, bucket.index()), sizes=tuple(sizes))
    send = state.send_dtype(grad.dtype)
    codings = [c for c, _ in proto.policy.codec_ns]
    squeezed, plain = [math.inf] * len(codings), math.inf
    for _ in range(repeats):
        for i, c in enumerate(codings):
            b.step = 1  # a step between the policy's re-evaluations (link_every > 1): what most steps cost
            b.prepare(grad.device)
            b.policy = replace(proto.policy.init(), coding=c)  # every repeat at the first widths, each coding
            proto.use_coding(c)
            t0 = time.perf_counter()
            Exchange(b, count=lambda *_: None).start({group.rank: (grad.clone(), group, b)})[group.rank].wait()
            squeezed[i] = min(squeezed[i], time.perf_counter() - t0)
        t0 = time.perf_counter()
        dist.all_reduce(grad.to(send, copy=True).div_(world), group=group.pgs[UP])
        plain = min(plain, time.perf_counter() - t0)
    fixed = 2 * proto.policy.messages * latency  # what the model prices per step whatever its size

    def per_coordinate(seconds: float) -> float:  # ns per coordinate of the whole bucket's step
        return (fixed + max(seconds - fixed, 0.0) * n / m) * 1e9 / n

    got = agree([per_coordinate(plain), *map(per_coordinate, squeezed)], max_over(group))
    return (*state.link, got[0], tuple(zip(codings, got[1:])))
