"""Transports: in-process simulation and torch.distributed (parameter server / peer all-gather / sharded server)."""

from typing import Any

from dqsgd.topology.links import Transport
from dqsgd.transport.sim import SimTransport

__all__ = ["Transport", "SimTransport", "TorchPSTransport", "TorchAllGatherTransport", "TorchShardedTransport", "TransportError",
           "RankDisagreement", "make_transport"]

_TORCH = {"TorchPSTransport", "TorchAllGatherTransport", "TorchShardedTransport", "TorchShardedTransport", "TransportError", "RankDisagreement", "make_transport"}


def __getattr__(name: str) -> Any:
    # torch.distributed transports load on first use: importing the package stays light and cycle-free.
    if name in _TORCH:
        from dqsgd.transport import torch_dist

        return getattr(torch_dist, name)
    raise AttributeError(f"module 'dqsgd.transport' has no attribute {name!r}")
