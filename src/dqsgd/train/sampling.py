"""Per-worker minibatches as pure functions of (seed, worker, step), from IID or label-skewed shards.

A worker's batch at step n depends only on (seed, w, n) (the streams of :mod:`dqsgd.core.rng`), so a
resumed run and a run on real processes draw exactly the same data. ``seed_for``, ``generator``
and the stream numbers live in :mod:`dqsgd.core.rng` and are re-exported here.
"""

from __future__ import annotations

import numpy as np
import torch

from dqsgd.core.rng import DATA_EPOCH, DATA_PARTITION, DATA_SHARDS, MODEL_INIT, QUANT, generator, seed_for

__all__ = ["DATA_EPOCH", "DATA_SHARDS", "MODEL_INIT", "QUANT", "WorkerBatches", "dirichlet_shards", "generator",
           "partition_shards", "seed_for"]

DIRICHLET_TRIES = 100  # draws of the class proportions before a too-small shard is reported


def dirichlet_shards(labels: torch.Tensor, workers: int, alpha: float, seed: int, min_size: int = 1) -> list[torch.Tensor]:
    """Label-skewed shards: for every class c, proportions p_c ~ Dirichlet(α·1_W) split c's samples
    (in a seeded random order) among the W workers, worker w taking the next ⌊p_c,w·n_c⌉ of them.

    Small α gives each worker few classes (α → 0: one class each), large α approaches an IID split.
    The shards are disjoint and cover the set; each is in increasing sample order (the epoch order is
    drawn later). The draw is repeated (at most ``DIRICHLET_TRIES`` times, the same sequence for a
    seed) until every shard holds at least ``min_size`` samples. A pure function of (labels, W, α, seed).
    """
    if workers < 1 or not alpha > 0:
        raise ValueError(f"dirichlet_shards: need workers >= 1 and alpha > 0, got {workers}, {alpha}")
    y = labels.cpu().numpy().astype(np.int64).reshape(-1)
    rng = np.random.default_rng(seed_for(seed, DATA_PARTITION))
    classes = np.unique(y)
    smallest = 0
    for _ in range(DIRICHLET_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(workers)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            cuts = np.round(np.cumsum(rng.dirichlet(np.full(workers, alpha))) * len(idx)).astype(np.int64)
            for w, piece in enumerate(np.split(idx, cuts[:-1])):
                parts[w].append(piece)
        shards = [np.sort(np.concatenate(p)) for p in parts]
        smallest = min(len(s) for s in shards)
        if smallest >= min_size:
            return [torch.from_numpy(s) for s in shards]
    raise ValueError(f"partition 'dirichlet' (alpha = {alpha}) left a worker with {smallest} samples, fewer than "
                     f"{min_size} (one batch), in {DIRICHLET_TRIES} draws: use a larger dirichlet_alpha, fewer "
                     f"workers or a smaller batch")


def partition_shards(kind: str, labels: torch.Tensor, workers: int, alpha: float, batch_size: int,
                     seed: int) -> list[torch.Tensor] | None:
    """The workers' shards of ``train.partition``: None for "iid" (:class:`WorkerBatches`' own split)."""
    if kind == "iid":
        return None
    if kind == "dirichlet":
        return dirichlet_shards(labels, workers, alpha, seed, batch_size)
    raise ValueError(f"partition must be 'iid' or 'dirichlet', got {kind!r}")


class WorkerBatches:
    """Disjoint shards of the training set, one per worker, reshuffled every epoch.

    ``shards``: the workers' shards (e.g. :func:`dirichlet_shards`); None = a seeded random split into
    W equal parts (IID)."""

    def __init__(self, n_train: int, workers: int, batch_size: int, seed: int,
                 shards: list[torch.Tensor] | None = None):
        if shards is None:
            if n_train // workers < batch_size:
                raise ValueError(
                    f"{n_train} training samples give each of {workers} workers fewer than one batch of {batch_size}"
                )
            perm = torch.randperm(n_train, generator=generator(seed, DATA_SHARDS))
            shards = [perm[w::workers] for w in range(workers)]
        if len(shards) != workers or any(len(s) < batch_size for s in shards):
            raise ValueError(f"need {workers} shards of at least one batch ({batch_size}), got sizes "
                             f"{[len(s) for s in shards]}")
        self.shards = shards
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
