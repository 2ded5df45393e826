"""Per-worker minibatches as pure functions of (seed, worker, step).

A worker's batch at step n depends only on (seed, w, n) (the streams of :mod:`dqsgd.rng`), so a
resumed run and a run on real processes draw exactly the same data. ``seed_for``, ``generator``
and the stream numbers live in :mod:`dqsgd.rng` and are re-exported here.
"""

from __future__ import annotations

import numpy as np
import torch

from dqsgd.rng import DATA_EPOCH, DATA_SHARDS, MODEL_INIT, QUANT, generator, seed_for

__all__ = ["DATA_EPOCH", "DATA_SHARDS", "MODEL_INIT", "QUANT", "WorkerBatches", "generator", "seed_for"]


class WorkerBatches:
    """Disjoint shards of the training set, one per worker, reshuffled every epoch."""

    def __init__(self, n_train: int, workers: int, batch_size: int, seed: int):
        if n_train // workers < batch_size:
            raise ValueError(
                f"{n_train} training samples give each of {workers} workers fewer than one batch of {batch_size}"
            )
        perm = torch.randperm(n_train, generator=generator(seed, DATA_SHARDS))
        self.shards = [perm[w::workers] for w in range(workers)]
        self.batch_size, self.seed = batch_size, seed
        self._cache: dict[int, tuple[int, torch.Tensor]] = {}

    def indices(self, worker: int, step: int) -> torch.Tensor:
        shard = self.shards[worker]
        per_epoch = len(shard) // self.batch_size
        epoch, i = divmod(step, per_epoch)
        cached = self._cache.get(worker)
        if cached is None or cached[0] != epoch:
            order = torch.randperm(len(shard), generator=generator(self.seed, DATA_EPOCH, worker, epoch))
            cached = (epoch, shard[order])
            self._cache[worker] = cached
        return cached[1][i * self.batch_size : (i + 1) * self.batch_size]
