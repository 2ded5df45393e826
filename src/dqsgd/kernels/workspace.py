"""Scratch buffers of the device codec kept from one call to the next (issue 36: no allocation per call).

The exchange of one bucket on the device path (:mod:`dqsgd.topology.exchange`) runs its codec calls
inside ``with use(mem.workspace)``, the rank's own dict for that bucket; the kernels' host side asks
:func:`scratch` for every buffer that lives only inside one call (the norms' bit patterns, ``1/r``,
``r/levels``, the decode's flags, the crc's partial values). Inside :func:`use` a buffer is made at the
bucket's first step and handed back, the same tensor, at every later one; outside it (any other caller)
each call gets a fresh one, as before.

Why reuse is safe: a scratch buffer is written and read by the launches of one call only, so the next
call's writes come after this call's reads in the stream's order; the workspace is one rank's for one
bucket (the bucket's :class:`~dqsgd.topology.state.Memory`), so two buckets in flight at once (DDP
issues bucket k+1 while bucket k's collectives run, and a CUDA future's callbacks may run on another
stream) never share a buffer, and a bucket's next step starts only once its previous step's future
has completed (DDP waits for every bucket's future at the end of backward). Buffers that leave the
call are not scratch: the payload buffers a collective sends, and the decoded sums returned to the caller.

The step's key. The encode kernels read the HashRNG key (the batched encode: its per-step part,
``triton_batch.split_keys``) from a 1-element int64 tensor, :func:`step_key`: the call site's buffer
of the workspace, into which each call writes the step's key with one ``fill_`` (no allocation after
the first step, no host copy, no host read). Everything else a bucket's codec calls launch is the same
at every step (the kernels, grids, scalar arguments and buffers), so a CUDA graph of them captured once
replays at every step: pass the tensor as ``key=`` (then the call does not write it) and write each
step's key into it with :func:`write_key` before the replay.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Iterator

import torch

from dqsgd.kernels.hashrng import signed64

__all__ = ["scratch", "step_key", "use", "write_key"]

_CURRENT: ContextVar[dict | None] = ContextVar("dqsgd_workspace", default=None)


@contextlib.contextmanager
def use(workspace: dict | None) -> Iterator[None]:
    """Codec calls inside take their scratch buffers from ``workspace`` (None: fresh ones)."""
    token = _CURRENT.set(workspace)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def scratch(tag: Any, n: int, dtype: torch.dtype, device: torch.device, *, zero: bool = False) -> torch.Tensor:
    """A 1-D buffer of ``n`` elements for call site ``tag``: the current workspace's (made once per
    tag, size, dtype and device), or a fresh one outside :func:`use`; zero-filled where ``zero``
    (in place: no allocation), else its contents are whatever the last call left."""
    ws = _CURRENT.get()
    if ws is None:
        return (torch.zeros if zero else torch.empty)(n, dtype=dtype, device=device)
    key = (tag, n, dtype, str(device))
    t = ws.get(key)
    if t is None:
        t = ws[key] = torch.empty(n, dtype=dtype, device=device)
    return t.zero_() if zero else t


def write_key(slot: torch.Tensor, key: int) -> torch.Tensor:
    """Write the 64-bit ``key`` (its bits, as int64) into ``slot`` in place, on its device: one fill
    (a kernel argument, no host-to-device copy); returns ``slot``."""
    return slot.fill_(signed64(int(key) & ((1 << 64) - 1)))


def step_key(tag: Any, key: int, device: torch.device, given: torch.Tensor | None = None) -> torch.Tensor:
    """The 1-element int64 tensor an encode kernel reads its key from: ``given`` as it is (the caller
    keeps it up to date with :func:`write_key`; ``key`` is then not written), else call site ``tag``'s
    buffer (:func:`scratch`) with ``key`` written in."""
    if given is None:
        return write_key(scratch(("key", tag), 1, torch.int64, device), key)
    if given.dtype != torch.int64 or given.numel() != 1 or given.device != torch.device(device):
        raise ValueError(f"key must be a 1-element int64 tensor on {device}, got {given.dtype} "
                         f"{tuple(given.shape)} on {given.device}")
    return given
