"""Sketched SGD's parameter-server downlink over 2 gloo ranks: a forged count in the candidates' message
is refused before anything of that count is allocated."""

from __future__ import annotations

import pytest

import _peer_ranks as pr
from dqsgd.cli.launch import spawn_local

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(240)
def test_a_forged_sketch_downlink_is_refused_before_allocating() -> None:
    """M1: a 2^34-byte announcement made the worker try to allocate 17 GB (2^32: 4.57 GB of RSS before a
    PayloadError). The candidates' message now has a size every rank knows; a count in it beyond m
    coordinates is refused, on every rank, before anything of that count is allocated."""
    size = (1 << 32) - 1
    results = spawn_local(pr.sketch_forged_downlink, 2, (size,), timeout=20, deadline=200)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    for got in (r.value for r in results):
        assert got["kind"] == "PayloadError", got
        assert f"index message of {size} coordinates of d = {pr.D}" in got["text"], got
        assert got["rss_growth_mb"] < 200, got
