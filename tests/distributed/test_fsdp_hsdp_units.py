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
    def __init__(self, index: int):
        self.index = index


def test_overlap_waits_for_every_write_and_raises_a_failed_one() -> None:
    """The last leg's wait covers every leg left in flight: it returns their units once each write has
    finished, empties the list, and raises the error of a write that failed."""
    from dqsgd.fsdp.hsdp import Overlap

    ov, legs = Overlap(), [_Leg(i) for i in range(3)]
    writes: list[torch.futures.Future] = [torch.futures.Future() for _ in range(2)]
    ov.legs = [(legs[1], writes[0]), (legs[2], writes[1])]  # type: ignore[list-item]
    assert ov.holds(legs[1]) and not ov.holds(legs[0])  # type: ignore[arg-type]
    for f in writes:
        f.set_result(None)
    assert ov.wait() == [1, 2] and ov.legs == []
    failed: torch.futures.Future = torch.futures.Future()
    failed.set_exception(RuntimeError("leg 2 failed"))
    ov.legs = [(legs[2], failed)]  # type: ignore[list-item]
    with pytest.raises(RuntimeError, match="leg 2 failed"):
        ov.wait()
    assert ov.legs == []
