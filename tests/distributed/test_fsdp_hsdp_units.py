"""The pieces of dqsgd.fsdp.hsdp that need no process group: the bucket the DDP hook reads."""

from __future__ import annotations

import pytest
import torch

from dqsgd.fsdp.hsdp import ShardBucket


def test_shard_bucket_gives_the_hook_what_it_reads() -> None:
    g = torch.arange(7, dtype=torch.float32)
    b = ShardBucket(3, g, [4, 3], last=True)
    assert b.buffer() is g and b.index() == 3 and b.is_last()
    assert [p.numel() for p in b.parameters()] == [4, 3]
    assert not ShardBucket(0, g, [7], last=False).is_last()


class _Leg:
    """What Overlap.settle calls on a replicate leg."""

    def __init__(self, index: int, log: list):
        self.index, self.log = index, log

    def _relay(self, where: str) -> None:
        self.log.append(("relay", where))

    def _write(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        self.log.append(("write", self.index))
        flat.copy_(out)


def _done(value: torch.Tensor) -> torch.futures.Future:
    f: torch.futures.Future = torch.futures.Future()
    f.set_result(value)
    return f


def test_overlapped_legs_settle_at_the_end_of_their_backward() -> None:
    """Outside a backward a leg waits (queue() is False); inside, the legs are settled once, when the
    backward ends — waited for, one relay, then written in order; legs a failed backward left are
    dropped, never written (the next backward starts afresh)."""
    from dqsgd.fsdp.hsdp import Overlap

    ov, log, order = Overlap(), [], []
    assert not ov.queue()
    shards = [torch.zeros(3), torch.zeros(3)]

    def leave(i: int, fail: bool = False):
        def fn(g: torch.Tensor) -> torch.Tensor:
            assert ov.queue() and ov.queue()
            ov.legs.append((_Leg(i, log), _done(torch.full((3,), float(i + 1))), shards[i]))
            order.append(i)
            assert not log  # nothing settles inside the backward
            if fail:
                raise RuntimeError("a later unit fails")
            return g
        return fn

    x = torch.ones(2, requires_grad=True)
    a, b = x * 2, x * 3
    a.register_hook(leave(0))
    b.register_hook(leave(1))
    (a + b).sum().backward()
    assert sorted(order) == [0, 1]
    assert log == [("relay", "FSDP units [0, 1], replicate legs of backward 1"), *(("write", i) for i in order)]
    assert shards[0].tolist() == [1.0] * 3 and shards[1].tolist() == [2.0] * 3
    log.clear()
    c = x * 4
    c.register_hook(leave(0, fail=True))
    with pytest.raises(RuntimeError, match="a later unit fails"):
        c.sum().backward()
    assert not log and len(ov.legs) == 1  # the failed backward's callback never ran
    d = x * 5
    d.register_hook(leave(1))
    d.sum().backward()
    assert log == [("relay", "FSDP units [1], replicate legs of backward 2"), ("write", 1)]  # unit 0's dropped
