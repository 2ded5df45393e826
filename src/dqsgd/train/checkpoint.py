"""Atomic checkpoints and exact resume.

A checkpoint holds everything that decides the rest of a run: model and optimizer state, the bit
policy's state, the error-feedback residuals, the ledger (budget spent and left), every
quantization generator, the step counter. Data positions need no state: a worker's batch is a pure
function of (seed, worker, step). Files are written to a temporary name, fsynced, then renamed,
so a crash leaves either the old or the new checkpoint, never half of one. Loading uses
``torch.load(weights_only=True)``: plain containers and tensors only, never arbitrary objects.

Integrity: a checkpoint carries ``sha256``, a digest of every other entry (tensor bytes, dtypes,
shapes, and every number and string), written by :func:`seal` and verified on load. A file that
does not match it (a flipped bit in a weight, a torn copy) is refused with
:class:`CorruptCheckpoint`; :func:`resume` then falls back to the intact ``*.prev.pt`` and says so
on stderr. The file stays a plain ``torch.save`` archive; older files without a digest still load.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
from pathlib import Path
from typing import Any

import torch

from dqsgd.ledger import Ledger
from dqsgd.pipeline import MethodState
from dqsgd.policies import state_from_dict, state_to_dict
from dqsgd.train.rundir import atomic_write, update_hash

FORMAT = 2
CHECKPOINT = "checkpoint.pt"


class CheckpointError(ValueError):
    """A checkpoint that does not belong to this run or cannot be read."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file whose bytes are damaged (checksum mismatch, truncated, unreadable)."""


def trainer_state(tr: Any) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "meta": _meta(tr),
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


def _meta(tr: Any) -> dict[str, Any]:
    return {"method": tr.entry.label, "numel": tr.numel, "steps": tr.cfg.steps, "seed": tr.seed,
            "workers": tr.cfg.workers, "rank": tr.transport.rank}


def digest(ck: dict[str, Any]) -> str:
    """sha256 of every entry but ``sha256``: tensors by dtype, shape and bytes; other leaves by ``repr``
    (exact for floats); dict keys in a fixed order. Equal contents, equal digest."""
    h = hashlib.sha256()
    update_hash(h, {k: v for k, v in ck.items() if k != "sha256"})
    return h.hexdigest()


def seal(ck: dict[str, Any]) -> dict[str, Any]:
    """``ck`` with its digest stored under ``sha256`` (what :func:`read_checkpoint` verifies)."""
    return {**ck, "sha256": digest(ck)}


def checkpoint_path(out: Path, transport: Any) -> Path:
    """``checkpoint.pt`` when this process runs every worker (simulation), else one file per rank."""
    whole = len(transport.local_workers) == transport.workers
    return out / (CHECKPOINT if whole else f"checkpoint-rank{transport.rank}.pt")


def previous_path(path: Path) -> Path:
    return path.with_name(path.stem + ".prev" + path.suffix)


def save_checkpoint(tr: Any, path: Path, keep_previous: bool = True) -> None:
    """Write ``path`` atomically; the checkpoint it replaces becomes ``*.prev.pt`` (``keep_previous``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(seal(trainer_state(tr)), buf)
    tmp = path.with_name(path.name + ".tmp")
    atomic_write(tmp, buf.getvalue())  # complete and synced, or absent
    if keep_previous and path.exists():
        os.replace(path, previous_path(path))  # a crash right here leaves *.prev.pt: still resumable
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_checkpoint(tr: Any, path: Path) -> dict[str, Any]:
    """The checkpoint at ``path``, checked to belong to ``tr``'s run and rank (never unpickles objects)."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for unsafe or corrupt files
        raise CorruptCheckpoint(f"{path}: cannot load checkpoint safely ({type(e).__name__}: {e})") from None
    if isinstance(ck, dict) and "sha256" in ck and ck["sha256"] != digest(ck):
        raise CorruptCheckpoint(f"{path}: checksum mismatch (the stored sha256 differs from the digest of the "
                                f"loaded contents): the file is damaged")
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a dqsgd checkpoint of format {FORMAT}")
    meta, want = ck["meta"], _meta(tr)
    if meta != want:
        raise CheckpointError(f"{path}: checkpoint is for {meta}, this run is {want}")
    return ck


def load_checkpoint(tr: Any, path: Path) -> None:
    _apply(tr, read_checkpoint(tr, path))


def resume(tr: Any, out: Path) -> int:
    """Load the newest checkpoint step that every rank holds under ``out``; returns it (0: none, fresh start).

    One small all-gather of the steps each rank has (current and previous file). Raises
    :class:`CheckpointError` when ranks hold checkpoints but none at a common step (a rank's files
    were lost): continuing would silently break the run's exactness.
    """
    path = checkpoint_path(out, tr.transport)
    held, corrupt = _intact(tr, (path, previous_path(path)))
    mine = sorted(held, reverse=True)[:2]
    everyone = tr.transport.all_gather_ints(mine + [-2 if corrupt and not held else -1] * (2 - len(mine)))
    lost = [r for r, steps in enumerate(everyone) if steps == [-2, -2]]
    if lost:
        raise CorruptCheckpoint(f"{out}: every checkpoint of rank(s) {lost} is damaged; cannot resume "
                                f"(start over with --overwrite)")
    common = set.intersection(*({s for s in steps if s >= 0} for steps in everyone))
    if not common:
        if any(s >= 0 for steps in everyone for s in steps):
            raise CheckpointError(f"{out}: the ranks hold checkpoints of steps {everyone} (rank order) with no step "
                                  f"in common; cannot resume exactly (restore the missing rank's files or start over)")
        return 0
    step = max(common)
    _apply(tr, held[step])
    if hasattr(tr.transport, "steps"):
        tr.transport.steps = step  # error messages count completed steps
    return step


def _intact(tr: Any, paths: tuple[Path, ...]) -> tuple[dict[int, dict[str, Any]], list[Path]]:
    """The readable checkpoints among ``paths`` by step, and the damaged ones (each named on stderr)."""
    held: dict[int, dict[str, Any]] = {}
    corrupt: list[Path] = []
    for p in paths:
        if not p.exists():
            continue
        try:
            ck = read_checkpoint(tr, p)
        except CorruptCheckpoint as e:
            corrupt.append(p)
            print(f"dqsgd: warning: {e}; skipping it (falling back to the previous checkpoint)", file=sys.stderr, flush=True)
            continue
        held[int(ck["next_step"])] = ck
    return held, corrupt


def _apply(tr: Any, ck: dict[str, Any]) -> None:
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
