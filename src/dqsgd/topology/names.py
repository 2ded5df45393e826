"""The topologies and the downlink widths, written once."""

from __future__ import annotations

TOPOLOGIES = ("ps", "allgather", "sharded")  # every topology of the trainer
HOOK_TOPOLOGIES = ("sharded", "allgather")    # those of the DDP hook (no parameter server in DDP)
FP32 = 32                                     # downlink width meaning "send the averaged shard in fp32"


def check_topology(topology: object, allowed: tuple[str, ...] = TOPOLOGIES) -> str:
    """``topology`` if it is one of ``allowed``, else a ValueError naming them."""
    if not isinstance(topology, str) or topology not in allowed:
        raise ValueError(f"unknown topology {topology!r}: use one of {', '.join(allowed)}")
    return topology


def check_downlink_bits(bits: object) -> int:
    """A sharded downlink width: 2..16 (stochastic uniform rounding, s = 2^(b-1) - 1) or 32 (fp32)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not (2 <= bits <= 16 or bits == FP32):
        raise ValueError(f"downlink_bits must be in [2, 16] (stochastic uniform, s = 2^(b-1) - 1) or 32 (fp32), "
                         f"got {bits!r}")
    return bits
