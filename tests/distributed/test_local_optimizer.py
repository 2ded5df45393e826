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
@pytest.mark.parametrize("what", ["local_steps", "method"])
def test_a_mismatch_across_ranks_is_refused_by_every_rank(what: str) -> None:
    results = spawn_local(_ranks_local.mismatch, 2, (what,), timeout=30, threads=1, deadline=100)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for r in results:
        err, seconds = r.value["error"], r.value["seconds"]
        assert err is not None and f"{what}" in err and "different configurations" in err, err
        assert seconds < 10, seconds
