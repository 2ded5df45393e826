"""Small simulated training runs on the synthetic dataset: the config and method-entry helpers the
training tests share (each test file keeps its own sizes)."""

from __future__ import annotations

from typing import Any

from dqsgd.method.config import method_config
from dqsgd.train.config import MethodEntry, TrainConfig


def train_config(**kw: Any) -> TrainConfig:
    """A synthetic-data MLP run: W = 4, 12 steps, batch 16, lr 0.1 unless ``kw`` says otherwise."""
    base: dict[str, Any] = dict(name="t", dataset="synthetic", model="mlp", workers=4, steps=12, batch_size=16,
                                lr=0.1, eval_every=6, seeds=(0,))
    return TrainConfig(**{**base, **kw})


def entry(name: str, **kw: Any) -> MethodEntry:
    """The registered method ``name`` with ``kw`` applied, labelled by its name."""
    return MethodEntry(name, method_config(name, **kw))
