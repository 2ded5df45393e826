"""One range check for every setting that more than one entry point takes.

The trainer's configuration (``[train]`` and ``[methods.*]``, also under ``--dry-run``), the DDP hook's
:class:`~dqsgd.ddp.HookState`, FSDP's :class:`~dqsgd.fsdp.FSDPState`, the Local SGD wrapper
:class:`~dqsgd.local.LocalSGDOptimizer` and the method configuration (the count sketch's sizes) take
the same kinds of values; each is checked here, once, with the same bounds and the same message
naming the setting. Every function returns the value (as its normal type) or raises ``ValueError``
(a config loader re-raises it as its own error type, naming the table).

Why the bounds:

* seeds: 0..2^32 − 1. The seed streams (:func:`dqsgd.core.rng.seed_for`) read 32 bits of each
  part, so a larger seed would silently run as a smaller one; a negative seed is not a seed.
* waits: (0, :data:`~dqsgd.core.timeouts.MAX_WAIT_S`] seconds (a week); ``1e30`` overflowed the
  wait primitives inside backward.
* the outer optimizer of Local SGD: ``outer_lr`` in (0, :data:`OUTER_LR_MAX`] (it scales the averaged
  pseudo-gradient of a round: 1 is plain averaging, DiLoCo uses 0.7, and 100 already extrapolates a
  round a hundred-fold; NaN poisons the model and 0 throws every round away), ``outer_momentum`` in
  [0, 1), and ``nesterov`` needs a momentum > 0.
* the count sketch: ``sketch_rows`` ≤ :data:`SKETCH_ROWS_MAX`, ``sketch_cols`` and ``sketch_p`` ≤
  :data:`SKETCH_FACTOR_MAX` (multiples of the k coordinates sent; 1e9 asked for hundreds of TB).
* ``min_compression_rate``: a finite number ≥ 0.
"""

from __future__ import annotations

import math
from typing import Any

from dqsgd.core.timeouts import check_wait

__all__ = ["LR_MAX", "OUTER_LR_MAX", "SEED_MAX", "SKETCH_FACTOR_MAX", "SKETCH_ROWS_MAX", "check_count", "check_outer",
           "check_rate", "check_seed", "check_sketch", "check_timeout"]

LR_MAX = 1e30                # learning rates: the optimizers work in float32 (max 3.4e38)
OUTER_LR_MAX = 100.0         # Local SGD's outer step size (see the module docstring)
SEED_MAX = (1 << 32) - 1     # the seed streams read 32 bits of each part
SKETCH_ROWS_MAX = 64         # hash rows of a count sketch (the paper's sketches have 1..5)
SKETCH_FACTOR_MAX = 100.0    # sketch columns and candidates per coordinate sent (the paper's: 1..10)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_count(where: str, value: Any, low: int = 0, high: int | None = None) -> int:
    """An integer in [low, high] (no upper bound when ``high`` is None)."""
    if not _is_int(value) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{where} must be an integer {span}, got {value!r}")
    return int(value)


def check_seed(where: str, value: Any) -> int:
    """A seed: an integer in 0..2^32 − 1 (see the module docstring)."""
    if not _is_int(value) or not 0 <= value <= SEED_MAX:
        raise ValueError(f"{where} must be an integer in 0..{SEED_MAX} (2^32 - 1), got {value!r}")
    return int(value)


def check_timeout(where: str, value: Any, none_ok: bool = True) -> float | None:
    """A wait limit in seconds, in (0, a week]; None (the process group's own) where ``none_ok``."""
    if value is None and none_ok:
        return None
    why = check_wait(where, float(value)) if _is_number(value) else f"{where} must be a number of seconds, got {value!r}"
    if why is not None:
        raise ValueError(why + (" (or None)" if none_ok else ""))
    return float(value)


def check_rate(where: str, value: Any) -> float:
    """A finite number >= 0 (``min_compression_rate``)."""
    if not _is_number(value) or not 0 <= value < math.inf:
        raise ValueError(f"{where} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_outer(optimizer: Any, lr: Any, momentum: Any, prefix: str = "") -> tuple[str, float, float]:
    """Local SGD's outer optimizer: ``"sgd"`` or ``"nesterov"``, its lr in (0, OUTER_LR_MAX] and its
    momentum in [0, 1) (> 0 for Nesterov). ``prefix`` names the keys as the caller spells them."""
    if optimizer not in ("sgd", "nesterov"):
        raise ValueError(f"{prefix}outer_optimizer must be 'sgd' or 'nesterov', got {optimizer!r}")
    if not _is_number(lr) or not 0 < lr <= OUTER_LR_MAX:
        raise ValueError(f"{prefix}outer_lr must be a number in (0, {OUTER_LR_MAX:g}], got {lr!r}")
    if not _is_number(momentum) or not 0 <= momentum < 1:
        raise ValueError(f"{prefix}outer_momentum must be a number in [0, 1), got {momentum!r}")
    if optimizer == "nesterov" and momentum == 0:
        raise ValueError(f"{prefix}outer_optimizer 'nesterov' needs {prefix}outer_momentum > 0")
    return optimizer, float(lr), float(momentum)


def check_sketch(rows: Any, cols: Any, p: Any) -> None:
    """A count sketch of ``rows`` rows and ``cols``·k columns, fetching ``p``·k candidates."""
    if not _is_int(rows) or not 1 <= rows <= SKETCH_ROWS_MAX:
        raise ValueError(f"sketch_rows must be an integer in 1..{SKETCH_ROWS_MAX}, got {rows!r}")
    if not _is_number(cols) or not 0 < cols <= SKETCH_FACTOR_MAX:
        raise ValueError(f"sketch_cols must be in (0, {SKETCH_FACTOR_MAX:g}] (columns per coordinate sent), "
                         f"got {cols!r}")
    if not _is_number(p) or not 1 <= p <= SKETCH_FACTOR_MAX:
        raise ValueError(f"sketch_p must be in [1, {SKETCH_FACTOR_MAX:g}] (candidates per coordinate sent), got {p!r}")
