"""Default limits, in seconds, on a wait for other processes: each collective of the torch
transports and of the DDP hook, each receive of the Double Quantization torch transport. Past the
limit the run stops with an error naming the rank and the operation. The meaning is the same
everywhere; the default depends on the entry point, and each can be set where it is used.

Other time constants are not these and stay where they are: the 2 s of the transports' best-effort
error board in the store (``transport/torch_dist.py``), and the grace periods and deadlines of
process management (``launch.py``, ``dq/dist.py``), which bound how long a failed run takes to end.
"""

from __future__ import annotations

__all__ = ["BENCH_COLLECTIVE_S", "DQ_WAIT_S", "HOOK_COLLECTIVE_S", "MAX_WAIT_S", "TRAIN_COLLECTIVE_S", "check_wait"]

TRAIN_COLLECTIVE_S = 60.0   # `dqsgd train --transport torch` (--timeout) and launch.spawn_local
HOOK_COLLECTIVE_S = 300.0   # the DDP hook (HookState(timeout=...)), inside a user's own training loop
BENCH_COLLECTIVE_S = 120.0  # `dqsgd bench hook` (--timeout)
DQ_WAIT_S = 120.0           # the Double Quantization torch transport (run.timeout_s)
MAX_WAIT_S = 7 * 86400.0  # the longest limit accepted: a week (1e10 s overflowed the wait primitives)


def check_wait(where: str, seconds: float) -> str | None:
    """Why ``seconds`` cannot be a wait limit (must be > 0, finite and at most :data:`MAX_WAIT_S`), or None."""
    if not 0 < seconds <= MAX_WAIT_S:
        return f"{where} must be in (0, {MAX_WAIT_S:g}] seconds (a week), got {seconds!r}"
    return None
