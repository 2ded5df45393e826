"""Checkpoint files: atomic writes, integrity, exact resume.

What goes into a checkpoint is the trainer's business (:meth:`dqsgd.train.trainer.Trainer.state_dict`:
model and optimizer state, the bit policy's state, the error-feedback residuals, the ledger, every
quantization generator, the step counter); this module only writes it to and reads it from files.
Files are written to a temporary name, fsynced, then renamed, so a crash leaves either the old or
the new checkpoint, never half of one. Loading uses ``torch.load(weights_only=True)``: plain
containers and tensors only, never arbitrary objects.

Integrity: a checkpoint carries ``sha256``, a digest of every other entry (tensor bytes, dtypes,
shapes, and every number and string), written by :func:`seal` and verified on load. A file that
does not match it (a flipped bit in a weight, a torn copy) is refused with
:class:`CorruptCheckpoint`; :func:`resume` then falls back to the intact ``*.prev.pt`` and says so
on stderr. The file stays a plain ``torch.save`` archive; older files without a digest still load.

The functions take any trainer-like object with ``state_dict()``, ``load_state_dict()``,
``run_meta()`` (what a file must belong to) and ``transport``.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
from pathlib import Path
from typing import Any, Protocol

import torch

from dqsgd.topology.agreement import refuse_changed
from dqsgd.train.rundir import atomic_write, update_hash
from dqsgd.train.runfiles import RunDirError, open_regular
from dqsgd.train.trainer import STATE_FORMAT
from dqsgd.transport import Transport

FORMAT = STATE_FORMAT
CHECKPOINT = "checkpoint.pt"


class Checkpointable(Protocol):
    """What the checkpoint functions need of a trainer."""

    transport: Transport

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...

    def run_meta(self) -> dict[str, Any]: ...


class CheckpointError(ValueError):
    """A checkpoint that does not belong to this run or cannot be read."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file whose bytes are damaged (checksum mismatch, truncated, unreadable)."""


def digest(ck: dict[str, Any]) -> str:
    """sha256 of every entry but ``sha256``: tensors by dtype, shape and bytes; other leaves by ``repr``
    (exact for floats); dict keys in a fixed order. Equal contents, equal digest."""
    h = hashlib.sha256()
    update_hash(h, {k: v for k, v in ck.items() if k != "sha256"})
    return h.hexdigest()


def seal(ck: dict[str, Any]) -> dict[str, Any]:
    """``ck`` with its digest stored under ``sha256`` (what :func:`read_checkpoint` verifies)."""
    return {**ck, "sha256": digest(ck)}


def checkpoint_path(out: Path, transport: Transport) -> Path:
    """``checkpoint.pt`` when this process runs every worker (simulation), else one file per rank."""
    whole = len(transport.local_workers) == transport.workers
    return out / (CHECKPOINT if whole else f"checkpoint-rank{transport.rank}.pt")


def previous_path(path: Path) -> Path:
    return path.with_name(path.stem + ".prev" + path.suffix)


def save_checkpoint(tr: Checkpointable, path: Path, keep_previous: bool = True) -> None:
    """Write ``path`` atomically; the checkpoint it replaces becomes ``*.prev.pt`` (``keep_previous``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(seal(tr.state_dict()), buf)
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


def read_checkpoint(tr: Checkpointable, path: Path) -> dict[str, Any]:
    """The checkpoint at ``path``, checked to belong to ``tr``'s run and rank (never unpickles objects)."""
    try:
        f = open_regular(path)  # never through a link; a FIFO or a device is refused, never waited on
    except RunDirError as e:
        raise CorruptCheckpoint(f"{path}: cannot load checkpoint safely ({e})") from None
    try:
        with f:
            ck = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for unsafe or corrupt files
        raise CorruptCheckpoint(f"{path}: cannot load checkpoint safely ({type(e).__name__}: {e})") from None
    if isinstance(ck, dict) and "sha256" in ck and ck["sha256"] != digest(ck):
        raise CorruptCheckpoint(f"{path}: checksum mismatch (the stored sha256 differs from the digest of the "
                                f"loaded contents): the file is damaged")
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a dqsgd checkpoint of format {FORMAT}")
    if not isinstance(ck.get("meta"), dict) or not isinstance(ck.get("next_step"), int):
        raise CheckpointError(f"{path}: malformed checkpoint (no 'meta' table or 'next_step')")
    refuse_changed(f"{path}: the checkpoint", ck["meta"], tr.run_meta(), error=CheckpointError)
    return ck


def load_checkpoint(tr: Checkpointable, path: Path) -> None:
    tr.load_state_dict(read_checkpoint(tr, path))


def resume(tr: Checkpointable, out: Path) -> int:
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
    tr.load_state_dict(held[step])
    return step


def _intact(tr: Checkpointable, paths: tuple[Path, ...]) -> tuple[dict[int, dict[str, Any]], list[Path]]:
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
