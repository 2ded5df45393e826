"""W workers in one process (what the DQSGD paper calls simulation).

The payloads are the very bytes a real network would carry — encoded and decoded by the same
codec, by the same exchange — only the wire is an in-process group (:class:`~dqsgd.topology.group.LocalGroup`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from dqsgd.topology.group import LocalGroup, local_groups
from dqsgd.topology.names import check_topology
from dqsgd.topology.registry import SIMULATED_DEFAULT


class SimTransport:
    """``topology``: which network the ledger accounts for (ps, allgather or sharded); for ``sharded``
    the trainer also runs the sharded step (each shard averaged and re-quantized on its own)."""

    def __init__(self, workers: int, topology: str = SIMULATED_DEFAULT):
        if workers < 1:
            raise ValueError(f"need at least one worker, got {workers}")
        check_topology(topology)
        self.workers = workers
        self.topology = topology
        self.steps = 0  # completed steps

    @property
    def local_workers(self) -> Sequence[int]:
        return range(self.workers)

    @property
    def is_server(self) -> bool:
        return True

    @property
    def rank(self) -> int:
        return 0

    def mean_loss(self, local: Sequence[float]) -> float:
        return sum(local) / len(local)

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        return [[int(v) for v in values]]

    def max_reduce(self, local: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack(list(local)).amax(dim=0)

    def exchange_groups(self) -> dict[int, LocalGroup]:
        """The W ranks of a new in-process group (a step's exchange; a new one each step, so that a
        step that stopped half way leaves nothing behind)."""
        return dict(enumerate(local_groups(self.workers)))
