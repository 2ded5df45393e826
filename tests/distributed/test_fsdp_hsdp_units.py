"""The pieces of dqsgd.fsdp.hsdp that need no process group: the bucket the DDP hook reads."""

from __future__ import annotations

import torch

from dqsgd.fsdp.hsdp import ShardBucket


def test_shard_bucket_gives_the_hook_what_it_reads() -> None:
    g = torch.arange(7, dtype=torch.float32)
    b = ShardBucket(3, g, [4, 3], last=True)
    assert b.buffer() is g and b.index() == 3 and b.is_last()
    assert [p.numel() for p in b.parameters()] == [4, 3]
    assert not ShardBucket(0, g, [7], last=False).is_last()
