"""Forged sizes and bytes, disagreeing ranks, overflow and skipped steps under the DDP hook and the ps
transport, 2 gloo ranks: each becomes a clear error on every rank (or the right number), nothing hangs."""

from __future__ import annotations

import pytest
import torch

import _engine_reliab_ranks as rr
from dqsgd.cli.launch import spawn_local

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TOPOLOGIES = ("sharded", "allgather")


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    results = spawn_local(rr.all_cases, 2, (), timeout=30, deadline=400)
    bad = [r for r in results if not r.ok]
    assert not bad, bad[0].error
    return [r.value for r in results]


@pytest.mark.timeout(450)
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("size", [400 << 20, 1 << 40], ids=["400MiB", "2^40"])
def test_an_oversized_announcement_is_refused_before_allocating(ranks: list[dict], topology: str, size: int) -> None:
    for r in ranks:
        got = r[f"D1/{topology}/{size}"]
        assert got["kind"] == "PayloadError", got
        assert f"rank 1 announced a payload of {size} bytes" in got["text"] and "refused before allocating" in got["text"]
        assert got["rss_growth_mb"] < 200, got  # nothing of the announced size was allocated


@pytest.mark.timeout(450)
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("coding", ["fixed", "elias"])
def test_a_flipped_byte_raises_payload_error_from_backward_on_every_rank(ranks: list[dict], topology: str,
                                                                        coding: str) -> None:
    for r in ranks:
        got = r[f"D13/{topology}/{coding}"]
        assert got["kind"] == "PayloadError", got
        assert "worker 1" in got["text"], got


@pytest.mark.timeout(450)
@pytest.mark.parametrize("field,named", [("bits", "method.bits"), ("topology", "topology"),
                                         ("method", "method.scheme"), ("coding", "method.coding"),
                                         ("start_iter", "start_iter"), ("downlink_bits", "downlink_bits")])
def test_ranks_with_other_configs_all_raise_naming_the_field(ranks: list[dict], field: str, named: str) -> None:
    for r in ranks:
        got = r[f"D2/{field}"]
        assert got["kind"] == "RankDisagreement", got
        assert f"{named} (rank(s) [1] differ from rank 0" in got["text"], got


@pytest.mark.timeout(450)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_the_mean_of_huge_finite_gradients_stays_finite(ranks: list[dict], topology: str) -> None:
    for r in ranks:
        g = r[f"D10/{topology}"]["grad"]
        assert bool(torch.isfinite(g).all())
        assert torch.allclose(g, torch.full_like(g, 2e38), rtol=1e-2)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_skipped_step_changes_no_error_feedback_memory(ranks: list[dict], topology: str) -> None:
    for r in ranks:
        got = r[f"D18/{topology}"]
        assert got["had"] and got["nan"] and got["same"], got


@pytest.mark.timeout(450)
def test_a_coded_downlink_past_its_cap_is_refused_on_every_rank(ranks: list[dict]) -> None:
    for r in ranks:
        got = r["D19"]
        assert got["kind"] == "PayloadError", got
        assert "the coded downlink of bucket" in got["text"], got
        assert "rank 1 (the server of shard 1) announced a payload of" in got["text"], got
        assert "refused before allocating" in got["text"], got


@pytest.mark.timeout(450)
def test_a_refusal_after_a_failed_backward_still_reaches_the_caller(ranks: list[dict]) -> None:
    """A backward that raised after the hook had sent its bucket never ran the hook's end-of-backward
    callback; the next backward (a new DDP, the same HookState) queues its own, so a payload refused
    there raises PayloadError from backward() on every rank instead of leaving NaN in the gradient."""
    for r in ranks:
        got = r["D20"]
        assert got["failed"] == ("RuntimeError", "injected failure"), got
        assert got["kind"] == "PayloadError" and "worker 1" in got["text"], got
