"""Small image models: multinomial logistic regression, the 3-layer MLP, and LeNet-5.

All take float ``(N, C, H, W)`` images and return logits ``(N, classes)``; all are initialised by
PyTorch's default schemes from the global RNG, so ``torch.manual_seed(s)`` before building makes
the initial weights reproducible.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

__all__ = ["LogisticRegression", "MLP", "LeNet5"]


class LogisticRegression(nn.Module):
    """Multinomial logistic regression: one linear layer on the flattened input (softmax in the loss)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


class MLP(nn.Module):
    """Flatten → 200 → ReLU → 200 → ReLU → classes.

    The fully connected MNIST network of the Double Quantization paper (Yu et al., NeurIPS 2019):
    784-200-200-10 with ReLU, 199 210 parameters on MNIST.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (200, 200)) -> None:
        super().__init__()
        widths = [math.prod(input_shape), *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998) with ReLU and max-pooling.

    conv 5×5 (C→6, padding 2: a 28×28 MNIST image is seen as the original 32×32 input) → ReLU →
    max-pool 2 → conv 5×5 (6→16) → ReLU → max-pool 2 → fc 400→120 → ReLU → fc 120→84 → ReLU →
    fc 84→classes. 61 706 parameters on MNIST. Chosen over a 16/32-channel net (80k parameters)
    because it costs half the time per step (≈ 5 ms vs ≈ 10 ms forward+backward at batch 32 on one
    core), and what this project measures is communication, not the last 0.3% of MNIST accuracy.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, channels: tuple[int, int] = (6, 16),
                 hidden: tuple[int, int] = (120, 84)) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"cnn needs (C, H, W) images, got input_shape {tuple(input_shape)}")
        c, h, w = input_shape
        # conv1 (padding 2) keeps the size, pool halves it; conv2 (no padding) loses 4, pool halves.
        side = [(s // 2 - 4) // 2 for s in (h, w)]
        if min(side) < 1:
            raise ValueError(f"cnn needs images of at least 12x12, got {h}x{w}; use 'mlp' or 'logreg'")
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(c, c1, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c2 * side[0] * side[1], hidden[0]), nn.ReLU(),
            nn.Linear(hidden[0], hidden[1]), nn.ReLU(),
            nn.Linear(hidden[1], num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
