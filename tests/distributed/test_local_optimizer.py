"""LocalSGDOptimizer in a user's loop on 2 gloo ranks: exact resume from its state dict (mid-round,
budgeted DQSGD, outer Nesterov), the same model on every rank after an exchange, and a clear refusal,
on every rank and within seconds, of a mismatched H or method."""

import pytest
import torch

import _ranks_local
from dqsgd.cli.launch import spawn_local

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(120)
def test_resume_from_state_dict_is_exact() -> None:
    results = spawn_local(_ranks_local.resume, 2, (4, 16, 6, "dqsgd"), timeout=30, threads=1, deadline=100)
    assert all(r.ok for r in results), [r.describe() for r in results]
    a, b = (r.value for r in results)
    for v in (a, b):
        assert torch.equal(v["full"], v["resumed"])
        assert v["bits"][0] == v["bits"][1] and v["link"][0] == v["link"][1] > 0
    assert torch.equal(a["full"], b["full"])  # 16 = 4 rounds of 4: the ranks end synchronized


@pytest.mark.timeout(120)
def test_error_fed_resume_restores_the_residual_exactly() -> None:
    """Error feedback on Δ (method option error_feedback=True): the resumed run carries the saved residual
    (cut mid-round, after two exchanges), so it ends bitwise where the uninterrupted run does."""
    results = spawn_local(_ranks_local.resume, 2, (4, 16, 10, "qsgd-2bit", {"error_feedback": True}), timeout=30,
                          threads=1, deadline=100)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for v in (r.value for r in results):
        assert torch.equal(v["full"], v["resumed"]) and v["link"][0] == v["link"][1] > 0
        assert v["residual"] is not None and float(v["residual"].abs().max()) > 0


@pytest.mark.timeout(120)
def test_error_fed_downlink_resume_restores_the_shard_residuals_exactly() -> None:
    """downlink_feedback=True at 3 bits: each rank's shard server keeps its rounding residual (non-zero), the
    state dict carries it (cut mid-round, after two exchanges), and the resumed run ends bitwise where the
    uninterrupted run does, the same model on both ranks."""
    options = {"downlink_bits": 3, "downlink_feedback": True}
    results = spawn_local(_ranks_local.resume, 2, (4, 16, 10, "qsgd-4bit", options), timeout=30, threads=1,
                          deadline=100)
    assert all(r.ok for r in results), [r.describe() for r in results]
    a, b = (r.value for r in results)
    for rank, v in enumerate((a, b)):
        assert torch.equal(v["full"], v["resumed"]) and v["link"][0] == v["link"][1] > 0
        full, resumed = v["down"]
        assert list(full) == list(resumed) == [rank]  # the shard this rank serves
        assert torch.equal(full[rank], resumed[rank]) and float(full[rank].abs().max()) > 0
    assert torch.equal(a["full"], b["full"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["local_steps", "method"])
def test_a_mismatch_across_ranks_is_refused_by_every_rank(what: str) -> None:
    results = spawn_local(_ranks_local.mismatch, 2, (what,), timeout=30, threads=1, deadline=100)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for r in results:
        err, seconds = r.value["error"], r.value["seconds"]
        assert err is not None and f"{what}" in err and "different configurations" in err, err
        assert seconds < 10, seconds


@pytest.mark.timeout(120)
@pytest.mark.parametrize("topology", ["sharded", "allgather"])
def test_compression_stats_count_both_legs_of_every_round(topology: str) -> None:
    """Two ranks: what one sends in a phase the other receives; 7 steps at H = 3 are 2 rounds; the
    references are 4 bytes per element per round (fp32) and a ring all-reduce of Δ (fp32: 2·2·(W−1)/W·4·d)."""
    from dqsgd.core.comm_stats import CompressionStats

    results = spawn_local(_ranks_local.stats, 2, (topology,), timeout=30, threads=1, deadline=100)
    assert all(r.ok for r in results), [r.describe() for r in results]
    a, b = (r.value for r in results)
    for me, other in ((a, b), (b, a)):
        s, o, d = me["stats"], other["stats"], me["numel"]
        assert type(s) is CompressionStats and (s.steps, s.rounds, s.refusals) == (7, 2, 0)
        assert (s.uplink_sent, s.downlink_sent) == (o.uplink_received, o.downlink_received)
        assert (s.downlink_sent > 0) == (topology == "sharded")
        assert s.uplink_sent > 0 and s.fp32_bytes == 2 * 4 * d and s.dense_bytes == 2 * 2 * (2 * 4 * d // 2)
        # link_bytes: per round and phase the larger of sent and received (equal-size rounds here)
        assert max(s.uplink_sent, s.uplink_received) + max(s.downlink_sent, s.downlink_received) == me["link"] > 0
        assert s.mean_bits == 4 and s.ratio == s.fp32_bytes / s.bytes_sent
        assert f"method='qsgd-4bit' (4 bits), topology={topology}" in me["repr"] and "rounds=2" in me["repr"]
