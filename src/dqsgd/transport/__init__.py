"""Transports: in-process simulation and torch.distributed (parameter server / peer all-gather)."""

from dqsgd.transport.base import Transport
from dqsgd.transport.sim import SimTransport

__all__ = ["Transport", "SimTransport"]
