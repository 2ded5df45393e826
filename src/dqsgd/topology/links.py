"""What a transport must do: move bytes between the workers and the server, nothing else.

A step of DQSGD Algorithm 2 is written once per topology (:mod:`dqsgd.topology.step`) against this
interface; ``SimTransport`` runs all W workers in one process, the torch.distributed transports run
one worker per process. Only the server (or, for the peer topology, every rank) aggregates.

Besides the payloads a transport offers a few small collectives of numbers, each a primitive with
no algorithm in it: ``max_reduce`` (an element-wise max of float tensors: TernGrad's scalers, the
step's non-finite check), ``all_gather_ints`` (every process's few integers: coded sizes, checkpoint
agreement), ``mean_loss`` (a sum over workers, for the metrics), and the few integers that travel
beside the downlink payload in ``broadcast``. What the numbers mean is the caller's business.
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
        """Element-wise max over all workers' tensors (TernGrad scaler sharing)."""
        ...

    def gather(self, payloads: Sequence[bytes], max_bytes: int) -> list[bytes] | None:
        """All W uplink payloads in worker order on the aggregating process(es), else None.
        ``max_bytes`` caps an announced payload size (refused before anything is allocated)."""
        ...

    def broadcast(self, payload: bytes | None, ints: Sequence[int],
                  max_bytes: int) -> tuple[bytes, list[int]]:
        """The server's downlink payload and a few integers sent beside it, delivered to every process.

        Every process passes the same number of ``ints``; a process that does not aggregate passes
        ``payload = None`` and placeholders, and receives the server's. Where every process aggregates
        (the peer topology) each holds its own and the transport may check that all hold the same.
        ``max_bytes`` caps the payload size a receiving process accepts (refused before allocating)."""
        ...


class ShardedTransport(Protocol):
    """Topology ``sharded``: every rank serves one shard; a process may run several workers (sim)."""

    workers: int
    topology: str
    steps: int

    @property
    def local_workers(self) -> Sequence[int]:
        """Worker ids whose gradients this process computes (sim: all of them)."""
        ...

    def exchange(self, rows: Sequence[Sequence[bytes]],
                 max_bytes: Sequence[int]) -> tuple[dict[int, list[bytes]], list[list[int]]]:
        """Uplink all-to-all. ``rows[i][j]``: local worker i's payload for shard j. Returns, for each
        served shard j, the W workers' payloads for j in worker order, and the W×W size matrix
        ``sizes[w][j]`` (known to every process). ``max_bytes[j]`` caps a shard-j payload."""
        ...

    def share(self, shards: dict[int, bytes], max_bytes: int) -> list[bytes]:
        """Downlink all-gather: the W shards' payloads, in shard order, on every process."""
        ...

    def exchange_groups(self) -> dict[int, Group]:
        """The group view of each local worker (:mod:`dqsgd.topology.group`) that a step's exchange
        (:class:`~dqsgd.topology.exchange.Exchange`) runs over."""
        ...

    def max_reduce(self, local: Sequence[torch.Tensor]) -> torch.Tensor:
        """Element-wise max over all workers' tensors (TernGrad scaler sharing)."""
        ...
