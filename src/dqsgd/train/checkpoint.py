"""Atomic checkpoints and exact resume.

A checkpoint holds everything that decides the rest of a run: model and optimizer state, the bit
policy's state, the error-feedback residuals, the ledger (budget spent and left), every
quantization generator, the step counter. Data positions need no state: a worker's batch is a pure
function of (seed, worker, step). Files are written to a temporary name, fsynced, then renamed,
so a crash leaves either the old or the new checkpoint, never half of one. Loading uses
``torch.load(weights_only=True)``: plain containers and tensors only, never arbitrary objects.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from dqsgd.ledger import Ledger
from dqsgd.pipeline import MethodState
from dqsgd.policies import state_from_dict, state_to_dict

FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that does not belong to this run or cannot be read."""


def trainer_state(tr: Any) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "meta": {"method": tr.entry.label, "numel": tr.numel, "steps": tr.cfg.steps, "seed": tr.seed,
                 "workers": tr.cfg.workers},
        "next_step": tr.next_step,
        "skipped": tr.skipped,
        "model": tr.model.state_dict(),
        "optimizer": tr.optimizer.state_dict(),
        "policy": state_to_dict(tr.state.policy) if tr.transport.is_server else None,
        "residuals": {int(w): r for w, r in enumerate(tr.state.residuals) if r is not None},
        "ledger": tr.ledger.state_dict() if tr.transport.is_server else None,
        "qgen": {int(w): g.get_state() for w, g in tr.qgen.items()},
        "bits": tr.state.bits,
    }


def save_checkpoint(tr: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(trainer_state(tr), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(tr: Any, path: Path) -> None:
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for unsafe or corrupt files
        raise CheckpointError(f"{path}: cannot load checkpoint safely ({type(e).__name__}: {e})") from None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a dqsgd checkpoint of format {FORMAT}")
    meta = ck["meta"]
    want = {"method": tr.entry.label, "numel": tr.numel, "steps": tr.cfg.steps, "seed": tr.seed, "workers": tr.cfg.workers}
    if meta != want:
        raise CheckpointError(f"{path}: checkpoint is for {meta}, this run is {want}")
    tr.model.load_state_dict(ck["model"])
    tr.optimizer.load_state_dict(ck["optimizer"])
    residuals = [None] * tr.cfg.workers
    for w, r in ck["residuals"].items():
        residuals[int(w)] = r
    if ck["policy"] is not None:
        policy = state_from_dict(type(tr.method.policy.init()), ck["policy"])
    else:
        from dqsgd.train.trainer import _RemoteBits

        policy = _RemoteBits(int(ck["bits"]))
    tr.state = MethodState(policy, residuals)
    if ck["ledger"] is not None:
        tr.ledger = Ledger.from_state_dict(ck["ledger"])
    for w, st in ck["qgen"].items():
        tr.qgen[int(w)].set_state(st)
    tr.next_step = int(ck["next_step"])
    tr.skipped = int(ck["skipped"])
