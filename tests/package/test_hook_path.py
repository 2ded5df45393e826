"""One DDP hook bucket, traced (``hook_path.py``): it runs the hook, the exchange and what lies below the
topology layer, and nothing of the trainer, the transports, FSDP or the command line."""

from __future__ import annotations

import pytest

from hook_path import trace_bucket

BELOW = ("core", "quantizers", "codecs", "kernels", "policies", "method", "topology")
MODULES = {"sharded": 20, "allgather": 19}  # was 24 and 22 before the merges of issue 35 (docs/design.md)


@pytest.mark.parametrize("topology", ["sharded", "allgather"])
def test_a_hook_bucket_passes_through_the_hook_and_the_layers_below_the_topology_only(topology: str) -> None:
    path = trace_bucket(topology=topology)
    assert path.first[:2] == ["dqsgd.ddp.comm_hook", "dqsgd.ddp.state"]
    assert "dqsgd.topology.exchange" in path.first
    outside = [m for m in path.first if m.split(".")[1] not in ("ddp", *BELOW)]
    assert outside == []
    assert len(path.first) <= MODULES[topology], path.first
