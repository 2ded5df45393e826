"""dqsgd.ddp.hook under real DDP on 2 gloo processes, compared with plain fp32 all-reduce."""

import math

import pytest
import torch

import _ranks
from dqsgd.ddp import HookState
from dqsgd.methods import method_config
from dqsgd.transport.launch import spawn_local

pytestmark = pytest.mark.distributed

W, REPS, S = 2, 64, 7  # processes; backward passes averaged for the unbiasedness check; 4-bit levels s = 2^3 - 1


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    results = spawn_local(_ranks.ddp_gradients, W, (REPS,), timeout=30, deadline=100)
    assert all(r.ok for r in results), [r.describe() for r in results]
    return [r.value for r in results]


@pytest.mark.timeout(120)
def test_identity_method_equals_allreduce(ranks: list[dict]) -> None:
    for r in ranks:
        for g in r["sgd"]["runs"]:
            torch.testing.assert_close(g, r["plain"], rtol=1e-5, atol=1e-7)  # only the summation order differs
    s = ranks[0]["sgd"]["stats"]
    assert s.steps == 2 and s.mean_bits == 32 and 0.99 < s.ratio < 1.0  # fp32 plus a small header


@pytest.mark.timeout(120)
def test_qsgd_4bit_is_unbiased_and_compresses_7_9x(ranks: list[dict]) -> None:
    exact = ranks[0]["plain"]
    runs = ranks[0]["qsgd-4bit"]["runs"]
    assert torch.equal(runs, ranks[1]["qsgd-4bit"]["runs"])  # every rank decodes the same bytes identically
    assert not torch.equal(runs[0], exact)
    # Stochastic rounding to the grid max|g_w|/s has variance <= (max|g_w|/s)^2/4 per coordinate; the
    # W workers and the REPS passes quantize independently, so for the mean of REPS averaged gradients
    #   E||mean - exact||^2 <= d * sum_w (max|g_w|/s)^2 / (4 W^2 REPS).
    d = exact.numel()
    bound = d * sum(float(r["local"].abs().max() / S) ** 2 for r in ranks) / (4 * W**2 * REPS)
    err = float(((runs.mean(0) - exact) ** 2).sum())
    assert 0 < err < 1.5 * bound  # a sum of d independent terms: concentrated well inside 1.5x its bound
    st = ranks[0]["qsgd-4bit"]["stats"]
    assert st.steps == REPS and st.mean_bits == 4
    assert st.bytes_sent == REPS * 2786  # header + d * 4 bits, measured from len(payload)
    assert math.isclose(st.ratio, 4 * d / 2786) and 7.9 < st.ratio < 8.0


@pytest.mark.timeout(120)
def test_dynamic_policy_agrees_on_every_rank(ranks: list[dict]) -> None:
    a, b = ranks[0]["dqsgd"], ranks[1]["dqsgd"]
    assert a["bits"] == b["bits"] and torch.equal(a["runs"], b["runs"])
    assert 2 <= a["stats"].mean_bits <= 16
    torch.testing.assert_close(a["runs"].mean(0), ranks[0]["plain"], rtol=0, atol=float(ranks[0]["plain"].abs().max()))
    t = ranks[0]["terngrad"]
    assert torch.equal(t["runs"], ranks[1]["terngrad"]["runs"]) and t["stats"].mean_bits == 2


def test_hook_state_validates() -> None:
    with pytest.raises(ValueError, match="unknown method|not a registered|method"):
        HookState(method="no-such-method")
    with pytest.raises(ValueError, match="seed"):
        HookState(seed=-1)
    with pytest.raises(ValueError, match="timeout"):
        HookState(timeout=0)
    with pytest.raises(ValueError, match="total_steps"):
        HookState(total_steps=0)
    with pytest.raises(TypeError, match="process_group"):
        HookState(process_group="world")  # type: ignore[arg-type]
    s = HookState(method=method_config("qsgd", bits=3))
    assert s.config.bits == 3 and math.isnan(s.compression_stats().ratio) and not hasattr(s, "__dict__")
