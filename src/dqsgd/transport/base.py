"""What a transport must do: move bytes between the workers and the server, nothing else.

A step of DQSGD Algorithm 2 is written once (``dqsgd.train.step``) against this interface;
``SimTransport`` runs all W workers in one process, the torch.distributed transports run one
worker per process. Only the server (or, for the peer topology, every rank) aggregates.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


class Transport(Protocol):
    workers: int

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
        """Element-wise max over all workers' tensors (TernGrad scaler sharing)."""
        ...

    def gather(self, payloads: Sequence[bytes]) -> list[bytes] | None:
        """All W uplink payloads in worker order on the aggregating process(es), else None."""
        ...

    def broadcast(self, payload: bytes | None, next_bits: int | None) -> tuple[bytes, int]:
        """The server's downlink payload and B_{n+1}, delivered to every process."""
        ...
