"""Exceptions the command line turns into one-line messages, importable without torch.

(The codec's ``PayloadError``, the quantizers' ``NonFiniteGradientError`` and the transports'
``TransportError`` live beside the code that raises them.)
"""

from __future__ import annotations

import signal
from pathlib import Path

__all__ = ["Interrupted"]


class Interrupted(Exception):
    """SIGINT/SIGTERM stopped a run between two steps (after saving a checkpoint where they are on)."""

    def __init__(self, signum: int, step: int, out: Path | None, saved: bool):
        self.signum, self.step, self.out, self.saved = signum, step, out, saved
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        where = f"checkpoint saved in {out}" if saved else "no checkpoint (train.checkpoint_every = 0): cannot resume"
        super().__init__(f"stopped by {name} after step {step}; {where}")
