"""The DDP hook past its horizon: one warning, and the policy keeps its last choice."""

from __future__ import annotations

import pytest

import _horizon_ranks as hr
from dqsgd.cli.launch import spawn_local

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("method", ["dqsgd", "qsgd-4bit"])
def test_past_total_steps_warns_once_and_keeps_the_last_width(method: str) -> None:
    results = spawn_local(hr.past_horizon, 2, (method, 3, 7), timeout=60, deadline=300)
    assert all(r.ok for r in results), [r.describe() for r in results]
    out = results[0].value
    if method == "qsgd-4bit":  # a fixed width has no horizon: nothing to say
        assert out["warnings"] == []
        return
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "past total_steps = 3" in out["warnings"][0] and "keeps its last choice" in out["warnings"][0]
    widths = out["widths"]
    assert all(w == widths[3] for w in widths[3:]), widths  # budget spent: the last width, unchanged
