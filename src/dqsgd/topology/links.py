"""What a transport must do for the trainer: give each local worker its group, and a few numbers.

A step is one exchange of its topology (:mod:`dqsgd.topology.exchange`, :mod:`dqsgd.topology.server`,
:mod:`dqsgd.topology.sketched`) over the groups of :meth:`Transport.exchange_groups`; ``SimTransport``
runs all W workers in one process (an in-process group), the torch.distributed transports one worker
per process (a process group). Only the server (or, for the peer topologies, every rank) aggregates.

Besides the groups a transport offers a few small collectives of numbers, each a primitive with no
algorithm in it: ``max_reduce`` (an element-wise max of float tensors: the step's non-finite check),
``all_gather_ints`` (every process's few integers: coded sizes, checkpoint agreement) and
``mean_loss`` (a sum over workers, for the metrics). What the numbers mean is the caller's business.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from dqsgd.topology.group import Group



class Transport(Protocol):
    workers: int
    steps: int  # completed steps (downlinks delivered), for error messages; a resumed trainer sets it

    @property
    def local_workers(self) -> Sequence[int]:
        """Worker ids whose gradients this process computes (sim: all of them)."""
        ...

    @property
    def is_server(self) -> bool:
        """Whether this process aggregates and runs the bit policy."""
        ...

    @property
    def rank(self) -> int:
        """This process's rank (sim: 0); rank 0 writes the run's metrics."""
        ...

    def mean_loss(self, local: Sequence[float]) -> float:
        """The mean of every worker's minibatch loss (for the metrics; sums in float64)."""
        ...

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every process's ``values`` (same length everywhere), in rank order (checkpoint agreement)."""
        ...

    def max_reduce(self, local: Sequence[torch.Tensor]) -> torch.Tensor:
        """Element-wise max over all workers' tensors (the step's non-finite check)."""
        ...

    def exchange_groups(self) -> dict[int, Group]:
        """The group view of each local worker (:mod:`dqsgd.topology.group`) that a step's exchange
        (:class:`~dqsgd.topology.exchange.Exchange`, :mod:`dqsgd.topology.sketched`) runs over."""
        ...
