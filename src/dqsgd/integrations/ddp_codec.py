"""The DDP hook's payload codec, now :mod:`dqsgd.topology.payloads` (this path keeps working)."""

from dqsgd.topology.payloads import *  # noqa: F401,F403
from dqsgd.topology.payloads import __all__  # noqa: F401
