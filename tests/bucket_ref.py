"""One bucket of a :class:`~dqsgd.method.pipeline.Method` through :class:`~dqsgd.topology.bucket.BucketProtocol`
(the one aggregation and downlink of every path), for tests that hold a method and its payloads."""

from __future__ import annotations

from typing import Sequence

import torch

from dqsgd.method.pipeline import Method
from dqsgd.topology.bucket import BucketProtocol
from dqsgd.topology.payloads import bytes_tensor


def protocol(m: Method, workers: int) -> BucketProtocol:
    """The parameter server's protocol of the whole vector of ``m`` (one shard, the server's downlink)."""
    return BucketProtocol(m.config, m.numel, (m.numel,), topology="ps", workers=workers, seed=0,
                          total_steps=m.total_steps, method=m)


def aggregate(m: Method, payloads: Sequence[bytes], bits: int) -> torch.Tensor:
    """G: the mean Σ_w (1/W)·decode(payload_w) in worker order, or the majority vote of the signs."""
    return protocol(m, len(payloads)).reduce(0, [bytes_tensor(p) for p in payloads], bits)


def downlink(m: Method, update: torch.Tensor, workers: int = 1) -> bytes:
    """The server's downlink payload of ``update`` (fp32, or the vote's signs)."""
    return bytes(protocol(m, workers).encode_down(0, update, 0).numpy())


def decode_downlink(m: Method, payload: bytes, workers: int = 1) -> torch.Tensor:
    return protocol(m, workers).decode_down([bytes_tensor(payload)])
