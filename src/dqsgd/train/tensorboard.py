"""An optional TensorBoard view of a run (``train.tensorboard = true`` or ``--tensorboard DIR``).

``metrics.jsonl`` stays the source of truth (tables, report and figures are rebuilt from it); this
logger only mirrors the same records into a ``SummaryWriter`` event file so the standard tool can
follow a run live. It is written by rank 0 only, next to the JSONL file. Scalars (x axis: the step):

* ``train/loss`` (mean over the W workers), ``train/lr``;
* ``test/accuracy``, ``test/loss`` at each evaluation;
* ``comm/bits`` (the step's width), ``comm/up_bytes``, ``comm/down_bytes`` (that step, all workers),
  ``comm/up_MB_total`` (cumulative uplink, MB = 1e6 bytes), ``comm/budget_left_bits`` (budgeted methods).

Needs the ``tensorboard`` package (``pip install 'dqsgd[tensorboard]'``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dqsgd.core.extras import require

_SCALARS = {"loss": "train/loss", "lr": "train/lr", "test_acc": "test/accuracy", "test_loss": "test/loss",
            "bits": "comm/bits", "up_bytes": "comm/up_bytes", "down_bytes": "comm/down_bytes",
            "budget_left": "comm/budget_left_bits"}


def tensorboard_dir(cfg: Any, run_out: Path, label: str, seed: int) -> Path | None:
    """Where a run's events go: ``tensorboard_dir/LABEL/seedK``, or ``RUN_DIR/tensorboard``, or nowhere."""
    if cfg.tensorboard_dir:
        return Path(cfg.tensorboard_dir) / label / f"seed{seed}"
    return run_out / "tensorboard" if cfg.tensorboard else None


def open_logger(cfg: Any, run_out: Path, label: str, seed: int, up_bytes_before: int,
                resume_step: int | None) -> TensorBoardLogger | None:
    """The run's logger if its config asks for one (see :func:`tensorboard_dir`), else None."""
    where = tensorboard_dir(cfg, run_out, label, seed)
    return None if where is None else TensorBoardLogger(where, up_bytes_before, resume_step)


class TensorBoardLogger:
    """Mirrors the JSONL records of one run into a TensorBoard event file."""

    def __init__(self, logdir: Path, up_bytes_before: int = 0, resume_step: int | None = None) -> None:
        """``resume_step``: a resumed run restarts at this step; events the interrupted process logged at
        steps >= it are hidden (TensorBoard's ``purge_step``), as the JSONL file is truncated there."""
        require("tensorboard", "train.tensorboard (the TensorBoard logger)")
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        self.writer = SummaryWriter(log_dir=str(self.logdir), purge_step=resume_step)
        self.up_total = up_bytes_before  # a resumed run continues the cumulative curve

    def write(self, rec: dict[str, Any]) -> None:
        step = int(rec["step"])
        for key, tag in _SCALARS.items():
            v = rec.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self.writer.add_scalar(tag, v, step)
        self.up_total += int(rec.get("up_bytes") or 0)
        self.writer.add_scalar("comm/up_MB_total", self.up_total / 1e6, step)

    def close(self) -> None:
        self.writer.close()
