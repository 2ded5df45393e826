"""The process groups of ``dqsgd.fsdp``: one transport (the rank agreement's all-gather) and one
exchange group (:class:`~dqsgd.topology.group.TorchGroup`) per process group and timeout, made at
its first use — the same call on every rank of the group —; a collective waited for with the
timeout; and the finished ``Work`` a synchronous call returns when asked for one."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dqsgd.topology.registry import SHARDED
from dqsgd.transport.torch_dist import TorchShardedTransport, TransportError, make_transport

if TYPE_CHECKING:
    from dqsgd.topology.group import TorchGroup

_NETS: dict[tuple[dist.ProcessGroup, float | None], TorchShardedTransport] = {}


class Done(dist.Work):
    """A finished collective (``async_op=True``): it ran before the call returned."""

    def wait(self, timeout=None) -> bool:  # type: ignore[no-untyped-def]
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


def transport(group: dist.ProcessGroup, timeout: float | None) -> TorchShardedTransport:
    """The transport over ``group`` (made once per group and timeout)."""
    key = (group, timeout)
    if key not in _NETS:
        _NETS[key] = make_transport(SHARDED.name, group, None, timeout)  # type: ignore[assignment]
        _NETS[key].steps = None  # FSDP's steps are not this transport's: its errors claim no count
    return _NETS[key]


def exchange_group(group: dist.ProcessGroup, timeout: float | None) -> TorchGroup:
    """This rank of ``group`` as the exchange's group: two groups of its own, one per leg, with the
    timeout; a failed collective raises :class:`~dqsgd.transport.torch_dist.TransportError`."""
    t = transport(group, timeout)
    return t.exchange_groups()[t.rank]


def wait(work: dist.Work, timeout: float | None, what: str) -> None:
    """Wait for ``work`` at most ``timeout`` seconds; a failed or late collective raises
    :class:`~dqsgd.transport.torch_dist.TransportError` naming it."""
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError) as e:
        raise TransportError(f"FSDP reduce-scatter: {what} failed (a peer crashed, stopped or did not answer "
                             f"within the timeout): {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
