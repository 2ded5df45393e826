"""Seeds and per-worker minibatches as pure functions of (seed, worker, step).

Common random numbers: for a given seed every method sees the same initial model and the same
minibatch sequence, because data and quantization draw from separate streams:
  stream 1 — the global shard permutation; stream 2 — worker w's order in epoch e;
  stream 3 — worker w's quantization generator; stream 4 — model initialization.
A worker's batch at step n depends only on (seed, w, n), so a resumed run and a run on real
processes draw exactly the same data.
"""

from __future__ import annotations

import numpy as np
import torch

DATA_SHARDS, DATA_EPOCH, QUANT, MODEL_INIT = 1, 2, 3, 4


def seed_for(*parts: int) -> int:
    """A 63-bit seed mixed from integers (numpy's SeedSequence: well-spread, deterministic)."""
    state = np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed_for(*parts))


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
