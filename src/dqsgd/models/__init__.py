"""Models for dqsgd, built by name for a dataset.

>>> import torch
>>> from dqsgd.models import DatasetInfo, build_model
>>> _ = torch.manual_seed(0)                      # initial weights come from the global RNG
>>> net = build_model("mlp", DatasetInfo(num_classes=10, input_shape=(1, 28, 28), kind="image"))
>>> net(torch.zeros(2, 1, 28, 28)).shape
torch.Size([2, 10])

``build_model`` accepts a :class:`dqsgd.data.Dataset` or anything with ``num_classes``,
``input_shape``, ``kind`` and ``vocab_size`` (:class:`DatasetInfoLike`), and rejects a model that
cannot read the dataset's inputs (a text model on images and vice versa). Extra keyword options
go to the model's constructor (e.g. ``pretrained_embeddings=`` for ``bilstm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from torch import nn

from .bilstm import BiLSTMAttention
from .resnet import STAGES, ResNet
from .simple import MLP, LeNet5, LogisticRegression

__all__ = ["MODELS", "BiLSTMAttention", "DatasetInfo", "DatasetInfoLike", "LeNet5", "LogisticRegression", "MLP",
           "ResNet", "build_model", "count_parameters"]


class DatasetInfoLike(Protocol):
    """What a model needs to know about its data (a :class:`dqsgd.data.Dataset` qualifies)."""

    @property
    def num_classes(self) -> int: ...

    @property
    def input_shape(self) -> tuple[int, ...]: ...

    @property
    def kind(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class DatasetInfo:
    """A dataset description without the data, for building a model before (or without) loading."""

    num_classes: int
    input_shape: tuple[int, ...]
    kind: str = "image"
    vocab_size: int = 0


@dataclass(frozen=True)
class _Entry:
    kind: str  # the dataset kind the model reads
    description: str
    build: Callable[..., nn.Module]  # (info, **options) -> model


def _bilstm(info: DatasetInfoLike, **options: Any) -> nn.Module:
    if info.vocab_size < 2:
        raise ValueError(f"bilstm needs a vocabulary (vocab_size ≥ 2), got {info.vocab_size}")
    return BiLSTMAttention(info.vocab_size, info.num_classes, **options)


_REGISTRY: dict[str, _Entry] = {
    "logreg": _Entry("image", "multinomial logistic regression on the flattened input",
                     lambda info, **o: LogisticRegression(info.input_shape, info.num_classes, **o)),
    "mlp": _Entry("image", "flatten → 200 → 200 → classes, ReLU (Double Quantization's 3-layer MNIST net)",
                  lambda info, **o: MLP(info.input_shape, info.num_classes, **o)),
    "cnn": _Entry("image", "LeNet-5: conv 6, pool, conv 16, pool, 120, 84, classes (62k params on MNIST)",
                  lambda info, **o: LeNet5(info.input_shape, info.num_classes, **o)),
    "resnet18": _Entry("image", "CIFAR ResNet-18: 3x3 stem, no max-pool, BasicBlocks [2, 2, 2, 2] (11.17M params)",
                       lambda info, **o: ResNet(STAGES["resnet18"], info.input_shape, info.num_classes, **o)),
    "resnet34": _Entry("image", "CIFAR ResNet-34: 3x3 stem, no max-pool, BasicBlocks [3, 4, 6, 3] (21.3M params)",
                       lambda info, **o: ResNet(STAGES["resnet34"], info.input_shape, info.num_classes, **o)),
    "bilstm": _Entry("text", "DQSGD's AG-News net: embedding 300 → 2-layer BiLSTM → attention pooling → 128 → "
                     "classes", _bilstm),
}

MODELS: dict[str, str] = {name: entry.description for name, entry in _REGISTRY.items()}


def build_model(name: str, dataset: DatasetInfoLike, **options: Any) -> nn.Module:
    """Build model ``name`` (one of :data:`MODELS`) sized for ``dataset``.

    Initialisation draws from PyTorch's global RNG: seed it with ``torch.manual_seed`` first for
    reproducible weights (every rank must build with the same seed).

    Raises:
        ValueError: unknown name (lists the known ones), or a model that cannot read the dataset.
    """
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    if dataset.kind != entry.kind:
        suited = sorted(n for n, e in _REGISTRY.items() if e.kind == dataset.kind)
        raise ValueError(f"model {name!r} reads {entry.kind} inputs but the dataset is {dataset.kind!r} "
                         f"(input_shape {tuple(dataset.input_shape)}); models for {dataset.kind} data: {suited}")
    if dataset.num_classes < 2:
        raise ValueError(f"need at least 2 classes, got {dataset.num_classes}")
    return entry.build(dataset, **options)


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of (trainable) parameters: the length of the gradient vector a worker sends."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
