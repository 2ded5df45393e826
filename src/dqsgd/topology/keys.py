"""The random keys of a bucket's step, written once for the trainer, both transports and the hook.

Worker ``w``'s payload for shard ``j`` (of ``shards``) of bucket ``bucket`` at step ``n`` rounds with
the counter-based uniforms ``HashRNG(seed_for(seed, QUANT, bucket), n, w·shards + j)``; shard ``j``'s
downlink with ``HashRNG(seed_for(seed, DOWNLINK, bucket), n, j)``; schemes that draw from a
``torch.Generator`` (TernGrad) use worker ``w``'s ``generator(seed, QUANT, w, bucket)``, drawn
shard after shard. Bucket 0 is the trainer's whole model: ``seed_for`` ignores trailing zeros, so
its keys are ``seed_for(seed, QUANT)`` and ``generator(seed, QUANT, w)``.
"""

from __future__ import annotations

import torch

from dqsgd.core.rng import DOWNLINK, QUANT, seed_for
from dqsgd.kernels import HashRNG


def uplink_seed(seed: int, bucket: int = 0) -> int:
    """The HashRNG seed of every uplink payload of ``bucket``."""
    return seed_for(seed, QUANT, bucket)


def downlink_seed(seed: int, bucket: int = 0) -> int:
    """The HashRNG seed of every downlink payload of ``bucket``."""
    return seed_for(seed, DOWNLINK, bucket)


def uplink_rng(useed: int, step: int, worker: int, shard: int, shards: int) -> HashRNG:
    """The uniforms of worker ``worker``'s payload for shard ``shard`` (``useed = uplink_seed(...)``)."""
    return HashRNG(useed, step, worker * shards + shard)


def downlink_rng(dseed: int, step: int, shard: int) -> HashRNG:
    """The uniforms of shard ``shard``'s downlink payload (``dseed = downlink_seed(...)``)."""
    return HashRNG(dseed, step, shard)


def worker_generator(seed: int, worker: int, bucket: int = 0) -> torch.Generator:
    """Worker ``worker``'s ``torch.Generator`` for ``bucket`` (schemes without hash uniforms)."""
    return torch.Generator().manual_seed(seed_for(seed, QUANT, worker, bucket))
