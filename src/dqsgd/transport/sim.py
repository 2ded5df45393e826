"""W workers in one process (what the DQSGD paper calls simulation).

The payloads are the very bytes a real network would carry — encoded and decoded by the same
codec — only the wire is a Python list.
"""

from __future__ import annotations

from typing import Sequence

import torch


class SimTransport:
    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"need at least one worker, got {workers}")
        self.workers = workers

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

    def gather(self, payloads: Sequence[bytes]) -> list[bytes]:
        if len(payloads) != self.workers:
            raise ValueError(f"sim transport: {len(payloads)} payloads for {self.workers} workers")
        return list(payloads)

    def broadcast(self, payload: bytes | None, next_bits: int | None) -> tuple[bytes, int]:
        if payload is None or next_bits is None:
            raise ValueError("sim transport: the server must provide the downlink payload and next bits")
        return payload, next_bits
