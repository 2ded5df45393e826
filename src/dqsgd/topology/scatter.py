"""What FSDP's reduce-scatter (:class:`~dqsgd.topology.exchange.Exchange` with ``scatter``) sends in
place of a downlink: each rank's statistics of the shard of G it holds, so that the policy of every
rank is fed the statistics of the whole G that no rank holds."""

from __future__ import annotations

import math
from typing import Any

import torch

from dqsgd.topology import payloads as codec
from dqsgd.topology.refusal import ROOM

__all__ = ["ShardStats"]


class ShardStats:
    """The statistics of G = [G_0, …, G_{W−1}] that a dynamic policy reads, from the shards the W ranks
    hold: each rank's Σ|G_j|^p (max |G_j| for p = ∞) and Σ G_j² in float64, and, for a policy that
    reads G itself, the elements of its fixed-stride sample inside shard j (float32, zero padded).
    ‖G‖_∞ is exact; ‖G‖₂² is summed in rank order. A message has room for a refusal's text.
    ``sample``: the statistics of an entropy sample of at most that many coordinates (None: the
    policy's own; :meth:`~dqsgd.topology.bucket.BucketProtocol.charge_side` prices candidates)."""

    def __init__(self, P: Any, sample: int | None = None):  # a BucketProtocol (which builds one: no import cycle)
        from dqsgd.policies.coded import read_stride, sample_stride

        m = P.method
        self.p, self.numel, self.bounds = m.p, P.numel, P.bounds
        self.dynamic = m.config.dynamic
        reads = self.dynamic and P.policy.needs_grad
        self.stride = 0 if not reads else sample_stride(P.numel, sample) if sample else read_stride(P.policy, P.numel)
        n = max(hi - lo for lo, hi in P.bounds)
        self.sampled = -(-n // self.stride) + 1 if self.stride else 0  # the most multiples of stride in n integers
        self.size = max(16 * self.dynamic + 4 * self.sampled, ROOM)  # room for a refusal (:mod:`dqsgd.topology.refusal`)
        self.extra = self.size - ROOM  # bytes the statistics add to the status message a fixed width sends too

    def partial(self, avg: torch.Tensor, j: int) -> torch.Tensor:
        """Rank j's statistics of its shard ``avg``, as bytes (none for a fixed width)."""
        if not self.dynamic:
            return torch.zeros(0, dtype=torch.uint8, device=avg.device)
        a = avg.to(torch.float64)
        part = a.abs().amax() if math.isinf(self.p) else a.abs().pow(self.p).sum()
        out = [torch.stack([part, a.square().sum()]).view(torch.uint8)]
        if self.stride:
            lo = self.bounds[j][0]
            picked = avg[-lo % self.stride::self.stride].to(torch.float32).contiguous()
            out.append(codec.pad(picked.reshape(-1).view(torch.uint8), 4 * self.sampled))
        return torch.cat(out)

    def combine(self, msgs: list[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """([‖G‖_p, ‖G‖₂] as float32, G's sample or None) from the W ranks' messages (None: fixed width)."""
        if not self.dynamic:
            return None, None
        parts = torch.stack([m[:16].clone().view(torch.float64) for m in msgs])
        norm = parts[:, 0].max() if math.isinf(self.p) else parts[:, 0].sum() ** (1.0 / self.p)
        norms = torch.stack([norm, parts[:, 1].sum().sqrt()]).to(torch.float32)
        if not self.stride:
            return norms, None
        counts = [-(-hi // self.stride) - -(-lo // self.stride) for lo, hi in self.bounds]
        sample = torch.cat([m[16:16 + 4 * c].clone().view(torch.float32) for m, c in zip(msgs, counts)])
        return norms, sample
