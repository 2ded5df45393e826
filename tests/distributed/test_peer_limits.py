"""Sketched SGD's parameter-server downlink over 2 gloo ranks: a forged announcement is refused by the
worker before it allocates anything of the announced size."""

from __future__ import annotations

import pytest

import _peer_ranks as pr
from dqsgd.cli.launch import spawn_local

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(240)
def test_a_forged_sketch_downlink_is_refused_before_allocating() -> None:
    """M1: a 2^34-byte announcement made the worker try to allocate 17 GB (2^32: 4.57 GB of RSS before a
    PayloadError); the candidates' message is now capped at its exact size, as qsgd's downlink is."""
    size = 1 << 34
    results = spawn_local(pr.sketch_forged_downlink, 2, (size,), timeout=20, deadline=200)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    server, worker = (r.value for r in results)
    assert server["kind"] == "RuntimeError", server  # the forger stops after its forged header
    assert worker["kind"] == "PayloadError", worker
    assert f"the server (rank 0) announced a payload of {size} bytes" in worker["text"], worker
    assert "refused before allocating" in worker["text"], worker
    assert worker["rss_growth_mb"] < 200, worker
