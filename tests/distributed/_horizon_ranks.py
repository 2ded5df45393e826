"""Rank function of the hook-horizon test (run inside ``spawn_local`` processes; importable by name)."""

from __future__ import annotations

import warnings
from typing import Any

import dqsgd.ddp
from _hook_ranks import ddp_model, grads


def past_horizon(rank: int, world: int, method: str, total_steps: int, steps: int) -> dict[str, Any]:
    """``steps`` backward passes with ``total_steps`` < ``steps``: the warnings and the widths per step."""
    state = dqsgd.ddp.HookState(method, None, seed=3, timeout=30.0, total_steps=total_steps)
    model = ddp_model(state)
    widths = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's default: a repeated warning (same text and place) once
        for s in range(steps):
            grads(model, rank, s)
            widths.append(state.current_bits())
    return {"warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
            "widths": widths}
