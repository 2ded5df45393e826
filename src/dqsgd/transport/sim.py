"""W workers in one process (what the DQSGD paper calls simulation).

The payloads are the very bytes a real network would carry — encoded and decoded by the same
codec — only the wire is a Python list.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dqsgd.topology.group import LocalGroup, local_groups
from dqsgd.topology.limits import check_sizes
from dqsgd.topology.names import check_topology


class SimTransport:
    """``topology``: which network the ledger accounts for (ps, allgather or sharded); for ``sharded``
    the trainer also runs the sharded step (each shard averaged and re-quantized on its own)."""

    def __init__(self, workers: int, topology: str = "ps"):
        if workers < 1:
            raise ValueError(f"need at least one worker, got {workers}")
        check_topology(topology)
        self.workers = workers
        self.topology = topology
        self.steps = 0  # completed steps (downlinks delivered)

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

    def gather(self, payloads: Sequence[bytes], max_bytes: int) -> list[bytes]:
        if len(payloads) != self.workers:
            raise ValueError(f"sim transport: {len(payloads)} payloads for {self.workers} workers")
        for w, p in enumerate(payloads):
            check_sizes([len(p)], [max_bytes], f"sim: worker {w}")
        return list(payloads)

    def exchange(self, rows: Sequence[Sequence[bytes]],
                 max_bytes: Sequence[int]) -> tuple[dict[int, list[bytes]], list[list[int]]]:
        if len(rows) != self.workers or any(len(r) != self.workers for r in rows):
            raise ValueError(f"sim transport: need {self.workers} rows of {self.workers} shard payloads")
        sizes = [[len(p) for p in r] for r in rows]
        for w, r in enumerate(sizes):
            check_sizes(r, max_bytes, f"sim: worker {w}")
        return {j: [r[j] for r in rows] for j in range(self.workers)}, sizes

    def share(self, shards: dict[int, bytes], max_bytes: int) -> list[bytes]:
        if set(shards) != set(range(self.workers)):
            raise ValueError(f"sim transport: need the downlink of all {self.workers} shards, got {sorted(shards)}")
        for j in range(self.workers):
            check_sizes([len(shards[j])], [max_bytes], f"sim: the server of shard {j}")
        self.steps += 1
        return [shards[j] for j in range(self.workers)]

    def exchange_groups(self) -> dict[int, LocalGroup]:
        """The W ranks of a new in-process group (a step's exchange; a new one each step, so that a
        step that stopped half way leaves nothing behind)."""
        return dict(enumerate(local_groups(self.workers)))

    def broadcast(self, payload: bytes | None, ints: Sequence[int],
                  max_bytes: int) -> tuple[bytes, list[int]]:
        if payload is None:
            raise ValueError("sim transport: the server must provide the downlink payload")
        check_sizes([len(payload)], [max_bytes], "sim: the server")
        self.steps += 1
        return payload, [int(v) for v in ints]
