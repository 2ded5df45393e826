"""Rank functions for the reliability tests (importable by the processes ``spawn_local`` starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.runner import run_one
from dqsgd.train.trainer import Trainer
from dqsgd.transport.torch_dist import make_transport


def cfg(**kw: Any) -> TrainConfig:
    base = dict(name="t", dataset="synthetic", model="mlp", workers=2, steps=6, batch_size=8, lr=0.1, eval_every=3,
                seeds=(0,), threads=1)
    return TrainConfig(**{**base, **kw})


def run_with_lr(rank: int, world: int, lrs: list[float], out: str) -> dict[str, Any]:
    """One run in which rank r was given lr ``lrs[r]`` (a user's mistake under torchrun)."""
    t = make_transport("ps")
    entry = MethodEntry("qsgd", method_config("qsgd"))
    with t.guard():
        s = run_one(cfg(lr=lrs[rank]), entry, load_dataset("synthetic"), 0, Path(out), transport=t, progress=False)
    return {"params": s["final_params"]}


def nan_on_one_rank(rank: int, world: int, mode: str, bad_rank: int, at_step: int) -> dict[str, Any]:
    """Rank ``bad_rank``'s gradient is NaN at ``at_step`` only; ``mode`` is train.on_nonfinite."""
    honest = Trainer.local_gradients

    def poisoned(self: Trainer, step: int):
        grads, losses = honest(self, step)
        if rank == bad_rank and step == at_step:
            grads = {w: torch.full_like(g, float("nan")) for w, g in grads.items()}
        return grads, losses

    Trainer.local_gradients = poisoned  # type: ignore[method-assign]
    t = make_transport("ps")
    entry = MethodEntry("qsgd", method_config("qsgd"))
    with t.guard():
        s = run_one(cfg(on_nonfinite=mode), entry, load_dataset("synthetic"), 0, None, transport=t, progress=False)
    return {"params": s["final_params"], "skipped": s["skipped_steps"]}


def run_into(rank: int, world: int, out: str) -> dict[str, Any]:
    """A plain 2-rank run into ``out`` (the test holds ``out``'s lock: rank 0 must refuse, rank 1 follow)."""
    t = make_transport("ps")
    entry = MethodEntry("qsgd", method_config("qsgd"))
    with t.guard():
        run_one(cfg(), entry, load_dataset("synthetic"), 0, Path(out), transport=t, progress=False)
    return {}
