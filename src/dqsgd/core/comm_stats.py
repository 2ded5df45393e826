"""The one statistics object of the DDP hook, FSDP and Local SGD: ``compression_stats()`` on each.

``HookState.compression_stats()`` (:mod:`dqsgd.ddp`), ``FSDPState.compression_stats()`` (:mod:`dqsgd.fsdp`)
and ``LocalSGDOptimizer.compression_stats()`` (:mod:`dqsgd.local`) return a :class:`CompressionStats`
with the same fields, counted by the calling rank since the state was made (or restored with its
``state_dict``). docs/api.md describes every field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CompressionStats"]


@dataclass(frozen=True)
class CompressionStats:
    """This rank's traffic, per phase, against what the uncompressed exchange would have cost."""

    uplink_sent: int = 0        # bytes this rank sent in the uplink phase (headers, flags, padding included)
    uplink_received: int = 0    # bytes it received in the uplink phase
    downlink_sent: int = 0      # bytes it sent in the downlink phase (0 where there is none)
    downlink_received: int = 0  # bytes it received in the downlink phase
    fp32_bytes: int = 0         # 4 bytes per gradient (or pseudo-gradient) element handled: the paper's reference
    dense_bytes: int = 0        # sent + received by the uncompressed collective, in the tensors' own dtype
    mean_bits: float = math.nan  # uplink code width per coordinate, averaged over every element handled
    steps: int = 0              # training steps: backward passes (DDP, FSDP) or optimizer steps (Local SGD)
    rounds: int = 0             # exchanges: one per step (DDP, FSDP), one per local_steps steps (Local SGD)
    refusals: int = 0           # exchanges of a bucket or unit sent uncompressed: warm-up or not worth compressing

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent, both phases."""
        return self.uplink_sent + self.downlink_sent

    @property
    def bytes_received(self) -> int:
        """Bytes this rank received, both phases."""
        return self.uplink_received + self.downlink_received

    @property
    def ratio(self) -> float:
        """``fp32_bytes / bytes_sent`` (the project's compression ratio; NaN before anything was sent)."""
        return self.fp32_bytes / self.bytes_sent if self.bytes_sent else math.nan

    @property
    def total_ratio(self) -> float:
        """``dense_bytes / (bytes_sent + bytes_received)``: the traffic saved against the uncompressed
        collective in the tensors' own dtype (NaN before any traffic)."""
        traffic = self.bytes_sent + self.bytes_received
        return self.dense_bytes / traffic if traffic else math.nan

    @property
    def allreduce_bytes(self) -> int:
        """``dense_bytes`` under the DDP hook's name (a ring all-reduce of the buckets)."""
        return self.dense_bytes
