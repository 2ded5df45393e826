"""Every width a dynamic policy can pick, compiled before its first step: no recompilation later.

Triton compiles a kernel once per *specialisation*: its ``constexpr`` arguments (the width among them:
the packing's loops are unrolled per width) and, for the integer arguments, whether each is 1 or a
multiple of 16 (payload lengths and code ranges change with the width). DQSGD changes a bucket's width
during training, so each new width used to compile its kernels in the middle of a step (seconds on a
GPU). :func:`warm_widths` runs one rank's uplink codec calls of the bucket — the batched encode of
every shard and the batched decode of W payloads of each shard, laid out as the all-to-all delivers
them — at every width of the policy's range, on zeros, once per bucket shape, range and device: the
same calls with the same argument shapes as a step, so every specialisation a later step launches is
already compiled. Only where the Triton batch runs (a GPU; the CPU under Triton's interpreter in the
tests); the downlink's width is fixed (a ``downlink_bits = "auto"`` downlink is not warmed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from dqsgd.topology import payloads as codec

if TYPE_CHECKING:
    from dqsgd.topology.bucket import BucketProtocol

__all__ = ["warm_widths"]

_WARMED: set[tuple] = set()


def warm_widths(proto: BucketProtocol, x: torch.Tensor, widths: Iterable[int], workers: int) -> bool:
    """Run the uplink's codec calls of ``proto``'s bucket at each of ``widths`` on zeros on ``x``'s
    device (module docstring), ``workers`` payloads per shard (the group's size: the decode's
    payload count is one of its specialisations), once per (shards, workers, widths, device); True if
    they ran now."""
    widths = tuple(widths)
    key = (tuple(proto.bounds), tuple(m.layout for m in proto.shards), workers, widths, str(x.device))
    if codec.batched(x) is not True or key in _WARMED or not all(codec.fast_path(m) for m in proto.shards):
        return False  # not the Triton batch (other codings code on the host: nothing to compile), or done
    if len(_WARMED) > 1024:
        _WARMED.clear()
    _WARMED.add(key)
    zeros = torch.zeros(proto.numel, dtype=torch.float32, device=x.device)
    flag = torch.zeros(1, dtype=torch.uint8, device=x.device)
    bad = torch.zeros((), dtype=torch.bool, device=x.device)
    for bits in widths:
        sent, _ = proto.encode(0, zeros, bits, 0, None)
        for j, m in enumerate(proto.shards):
            n = sent[j].numel()
            recv = codec.messages([sent[j]] * workers, flag)  # W messages of shard j, each with its flag byte
            received = [recv[w * (n + 1) : w * (n + 1) + n] for w in range(workers)]
            proto.reduce(j, received, bits, out=torch.zeros(m.numel, dtype=torch.float32, device=x.device), bad=bad)
    return True
