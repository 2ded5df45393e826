"""Rank function of the error-fed downlink's equivalence test (``test_downlink_feedback.py``): the
trainer over the torch transport and DDP with the hook, both with a 2-bit error-fed downlink."""

from __future__ import annotations

from typing import Any

import torch

import _engine_ranks as er

METHODS = ("qsgd-4bit", "dqsgd")
DOWN = 2  # below the safe width: only with the error-fed downlink


def fed(rank: int, world: int) -> dict[str, Any]:
    """Per method: the trainer's parameters, widths and downlink residuals (this rank's shard), and
    the hook's parameters."""
    from dqsgd.transport import make_transport

    out = {}
    for method in METHODS:
        tr, _ = er.run_trainer(method, "sharded", make_transport("sharded", timeout=60.0), world,
                               downlink_bits=DOWN, downlink_feedback=True)
        params = er.run_ddp(rank, world, method, "sharded", tr, downlink_bits=DOWN, downlink_feedback=True)
        out[method] = {"trainer_params": torch.cat([p.detach().reshape(-1) for p in tr.params]),
                       "trainer_down": dict(tr.state.down_residuals), "hook_params": params,
                       "trainer_bits": [r.bits for r in tr.ledger.records]}
    return out
