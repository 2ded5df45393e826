"""A small seeded Gaussian-cluster image set for fast tests (no files, no downloads).

Each class c has a centre ``μ_c ~ N(0, I)`` in ``R^{C·H·W}``; a sample of class c is
``μ_c + σ·ε`` with ``ε ~ N(0, I)`` and σ = 2. With 64 dimensions the centres are ≈ 11 apart, so a
linear model separates the classes well but not perfectly — enough for a loss to fall visibly in
a few steps. Inputs are then standardised with the training mean and std (one scalar each).
"""

from __future__ import annotations

import torch

from .base import Dataset, Split

__all__ = ["make_synthetic"]


def make_synthetic(seed: int = 0, *, num_train: int = 1024, num_test: int = 256, num_classes: int = 10,
                   shape: tuple[int, int, int] = (1, 8, 8), noise: float = 2.0) -> Dataset:
    """Balanced seeded clusters: labels cycle 0..K−1 then are shuffled by the same generator."""
    gen = torch.Generator().manual_seed(seed)
    dim = shape[0] * shape[1] * shape[2]
    centres = torch.randn(num_classes, dim, generator=gen)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.arange(n, dtype=torch.int64) % num_classes
        y = y[torch.randperm(n, generator=gen)]
        x = centres[y] + noise * torch.randn(n, dim, generator=gen)
        return x.view(n, *shape), y

    x_train, y_train = draw(num_train)
    x_test, y_test = draw(num_test)
    mean, std = x_train.mean(), x_train.std()
    return Dataset(
        name="synthetic",
        train=Split(((x_train - mean) / std).contiguous(), y_train),
        test=Split(((x_test - mean) / std).contiguous(), y_test),
        num_classes=num_classes,
        input_shape=shape,
        kind="image",
        note=f"synthetic Gaussian clusters (seed {seed}, noise {noise}), for tests only",
    )
