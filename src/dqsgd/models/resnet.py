"""CIFAR-style ResNets (He et al., CVPR 2016), as used for CIFAR-10 (ResNet-18) and CIFAR-100
(ResNet-34) in the DQSGD paper.

The CIFAR variant differs from the ImageNet one only in the stem: a 3×3 stride-1 convolution and
no max-pool, so a 32×32 input reaches the last stage at 4×4. Stages of BasicBlocks with widths
64/128/256/512 ([2, 2, 2, 2] for ResNet-18, [3, 4, 6, 3] for ResNet-34), stride 2 at the start of
stages 2-4 with a 1×1-conv + BN shortcut, global average pooling, one linear layer. On
3×32×32 with 10 classes ResNet-18 has 11 173 962 parameters, the usual CIFAR ResNet-18 figure.
Global pooling lets the same net run on 1×28×28 (Fashion-MNIST) unchanged but for the stem.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["BasicBlock", "ResNet", "STAGES"]

STAGES: dict[str, tuple[int, int, int, int]] = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}


class BasicBlock(nn.Module):
    """Two 3×3 conv-BN layers with an identity (or 1×1 conv-BN projection) shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR ResNet: 3×3 stem (64) → four BasicBlock stages → global average pool → linear."""

    def __init__(self, blocks: Sequence[int], input_shape: Sequence[int], num_classes: int,
                 widths: Sequence[int] = (64, 128, 256, 512)) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"resnet needs (C, H, W) images, got input_shape {tuple(input_shape)}")
        if len(blocks) != len(widths):
            raise ValueError(f"{len(blocks)} stage depths for {len(widths)} stage widths")
        self.stem = nn.Sequential(nn.Conv2d(input_shape[0], widths[0], 3, padding=1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages: list[nn.Module] = []
        in_planes = widths[0]
        for i, (depth, planes) in enumerate(zip(blocks, widths)):
            layers = []
            for j in range(depth):
                layers.append(BasicBlock(in_planes, planes, stride=2 if (i > 0 and j == 0) else 1))
                in_planes = planes
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
