"""dqsgd.ddp.hook under real DDP on gloo processes, against the bucket protocol run in one process.

The reference runs :class:`dqsgd.topology.bucket.BucketProtocol` on the ranks' local buckets: the
hooked buckets must equal it bit for bit.
"""

import math

import pytest
import torch

import _hook_ranks as hr
from dqsgd.cli.launch import spawn_local
from dqsgd.core.sharding import shard_bounds, shard_sizes
from dqsgd.ddp import HookState
from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.topology.bucket import BucketProtocol
from dqsgd.topology.exchange import in_process

pytestmark = pytest.mark.distributed

W, REPS, SEED = 3, 32, 3
SHARDED, ALLGATHER = {}, {"topology": "allgather"}
CASES = [("qsgd-4bit", SHARDED), ("qsgd-4bit", ALLGATHER), ("dqsgd", SHARDED), ("dqsgd", ALLGATHER),
         ("terngrad", SHARDED), ("signsgd", SHARDED), ("ef-signsgd", SHARDED), ("sgd", SHARDED),
         ("qsgd-4bit", {"downlink_bits": "fp32"})]


def key(method: str, kw: dict) -> str:
    return f"{method}/{kw}"


@pytest.fixture(scope="module")
def w3() -> list[dict]:
    results = spawn_local(hr.w3_cases, W, (CASES, REPS), timeout=60, deadline=400)
    assert all(r.ok for r in results), [r.describe() for r in results]
    return [r.value for r in results]


def reference(method: str, kw: dict, locals_: list[torch.Tensor], sizes: list[int], bits: int, index: int,
              step: int, dbits: int) -> torch.Tensor:
    """The averaged bucket every rank must return: the bucket's protocol run in one process on the W
    local buckets at the widths the hook used (the trainer runs the same protocol and picks the same
    widths: tests/distributed/test_engine_equivalence.py)."""
    cfg, n, topology = method_config(method), locals_[0].numel(), kw.get("topology", "sharded")
    down = HookState(cfg, topology=topology, downlink_bits=kw.get("downlink_bits")).downlink_bits
    proto = BucketProtocol(cfg, n, sizes, topology=topology, workers=W, seed=SEED, bucket=index, total_steps=20,
                           downlink_bits=down)
    return in_process(proto, locals_, bits, step, dbits=dbits if down == "auto" else None)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("method,kw", [c for c in CASES if c[0] in ("qsgd-4bit", "dqsgd")])
def test_hooked_bucket_equals_reference_bitwise(w3: list[dict], method: str, kw: dict) -> None:
    runs = [r["runs"][key(method, kw)] for r in w3]
    assert all(r["bits"] == runs[0]["bits"] for r in runs)  # every rank picks the same width every step
    per_rank = [r["buckets"] for r in runs]
    assert len(per_rank[0]) == hr.STEPS  # one bucket (5471 elements, not divisible by W = 3) per step
    for step in range(hr.STEPS):
        index, _, sizes, got = per_rank[0][step]
        assert sum(sizes) == 5471 and 5471 % W
        bits, dbits = runs[0]["bits"][step][index], runs[0]["down"][step][index]
        want = reference(method, kw, [p[step][1] for p in per_rank], sizes, bits, index, step, dbits)
        for p in per_rank:
            assert torch.equal(p[step][3], want), (method, kw, step)
    for r in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["runs"], runs[0]["runs"]))
    assert all(r["down"] == runs[0]["down"] for r in runs)  # and the same downlink width
    if method == "dqsgd":
        assert {b[0] for b in runs[0]["bits"]} <= set(range(2, 17))
    if method == "dqsgd" and kw == SHARDED:  # downlink_bits "auto": a safe width every step (no feedback)
        assert {d[0] for d in runs[0]["down"]} <= set(range(4, 17))


@pytest.mark.timeout(500)
def test_sharded_two_stage_estimator_is_unbiased(w3: list[dict]) -> None:
    """E||mean of REPS hooked buckets − exact||² ≤ Σ_j n_j·[Σ_w (r_wj/7)²/(4W²) + (R_j/127)²/4]/REPS:
    the uplink rounds each worker's shard on the grid r_wj/7 (4 bits), the downlink the average on
    the grid R_j/127 (8 bits, R_j = max|average| ≤ max_w r_wj); stochastic rounding on a grid of
    step h has variance ≤ h²/4, and all roundings are independent and unbiased."""
    exact = w3[0]["mc"]["plain"]
    runs = w3[0]["mc"]["runs"]
    assert all(torch.equal(runs, r["mc"]["runs"]) for r in w3)
    locals_ = [r["mc"]["local"] for r in w3]
    bound = 0.0
    for lo, hi in shard_bounds(exact.numel(), W):
        r = [float(g[lo:hi].abs().max()) for g in locals_]
        bound += (hi - lo) * (sum((x / 7) ** 2 for x in r) / (4 * W**2) + (max(r) / 127) ** 2 / 4)
    err = float(((runs.mean(0) - exact) ** 2).sum())
    assert 0 < err < 1.5 * bound / REPS, (err, bound / REPS)


@pytest.mark.timeout(500)
def test_stats_count_the_predicted_bytes(w3: list[dict]) -> None:
    cfg, n = method_config("qsgd-4bit"), 5471
    sizes = w3[0]["runs"][key("qsgd-4bit", SHARDED)]["buckets"][0][2]
    shards = [Method(cfg, hi - lo, 20, list(shard_sizes(sizes, lo, hi))) for lo, hi in shard_bounds(n, W)]
    up = [m.message_bits(4) // 8 + 1 for m in shards]  # payload + flag byte
    dmax = max(m.message_bits(8) // 8 for m in shards) + 1  # payload + status byte
    allreduce = 2 * (2 * (W - 1) * 4 * n // W)
    for rank, r in enumerate(w3):
        s = r["runs"][key("qsgd-4bit", SHARDED)]["stats"]
        assert s.bytes_sent == hr.STEPS * (sum(up) - up[rank] + (W - 1) * dmax)
        assert s.bytes_received == hr.STEPS * ((W - 1) * up[rank] + (W - 1) * dmax)
        assert (s.uplink_sent, s.uplink_received) == (hr.STEPS * (sum(up) - up[rank]), hr.STEPS * (W - 1) * up[rank])
        assert s.downlink_sent == s.downlink_received == hr.STEPS * (W - 1) * dmax
        assert s.rounds == hr.STEPS and s.refusals == 0
        assert s.allreduce_bytes == hr.STEPS * allreduce and s.fp32_bytes == hr.STEPS * 4 * n
        assert s.steps == hr.STEPS and s.mean_bits == 4
        assert math.isclose(s.total_ratio, s.allreduce_bytes / (s.bytes_sent + s.bytes_received))
        # ≈ 2·(W−1)/W·n·(4 + 8)/8 bytes each way: within the headers of that
        assert 1.0 < s.bytes_sent / (hr.STEPS * (W - 1) / W * n * 12 / 8) < 1.03
        a = r["runs"][key("qsgd-4bit", ALLGATHER)]["stats"]
        full = Method(cfg, n, 20, sizes).message_bits(4) // 8 + 1
        assert a.bytes_sent == a.bytes_received == a.uplink_sent == hr.STEPS * (W - 1) * full
        assert a.downlink_sent == a.downlink_received == 0


@pytest.mark.timeout(500)
def test_other_schemes_agree_on_every_rank(w3: list[dict]) -> None:
    for method, kw in CASES[4:]:
        runs = [r["runs"][key(method, kw)] for r in w3]
        for r in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r["runs"], runs[0]["runs"])), method
    for step, g in enumerate(w3[0]["runs"][key("sgd", SHARDED)]["runs"]):  # ratio < 1: all-reduced as is
        torch.testing.assert_close(g, w3[0]["runs"]["plain"][step], rtol=1e-5, atol=1e-7)
    sign = w3[0]["runs"][key("signsgd", SHARDED)]["runs"][0]
    assert set(sign.unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert w3[0]["runs"][key("terngrad", SHARDED)]["stats"].mean_bits == 2


@pytest.fixture(scope="module")
def w2() -> list[dict]:
    results = spawn_local(hr.w2_cases, 2, (), timeout=60, deadline=400)
    assert all(r.ok for r in results), [r.describe() for r in results]
    return [r.value for r in results]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", ["amp", "amp-ag"])
def test_overflow_on_one_rank_makes_every_rank_skip(w2: list[dict], case: str) -> None:
    for r in w2:
        a = r[case]
        assert torch.isnan(a["grads"][0]).all()  # every rank: a non-finite averaged bucket ...
        assert torch.equal(a["params"][0], a["init"])  # ... so GradScaler skipped the step
        assert a["scales"] == [512.0, 512.0]  # halved once, then a normal step (no growth yet)
        assert torch.isfinite(a["grads"][1]).all() and not torch.equal(a["params"][1], a["init"])
    assert torch.equal(w2[0][case]["params"][1], w2[1][case]["params"][1])
    assert w2[0][case]["bits"] == w2[1][case]["bits"]
    for r in w2:  # said once on every rank, naming the step
        assert len(r[case]["said"]) == 1 and "step 0" in r[case]["said"][0], r[case]["said"]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", ["resume", "resume-fed"])
def test_resume_continues_exactly(w2: list[dict], case: str) -> None:
    """``resume-fed``: a 2-bit error-fed downlink, whose shard server residual is in the state."""
    for r in w2:
        x = r[case]
        assert torch.equal(x["ref"], x["resumed"])  # bitwise the uninterrupted run
        ref, res = x["ref_state"], x["resumed_state"]
        assert ref["buckets"].keys() == res["buckets"].keys()
        for i in ref["buckets"]:
            assert ref["buckets"][i]["policy"] == res["buckets"][i]["policy"]  # the budget ledger included
            assert ref["buckets"][i]["step"] == res["buckets"][i]["step"] == 7
        assert ref["counters"] == res["counters"]
        if case == "resume-fed":
            for i in ref["buckets"]:
                a, b = ref["buckets"][i]["down_residual"], res["buckets"][i]["down_residual"]
                assert a is not None and a.abs().max() > 0 and torch.equal(a, b)
        assert x["unpickled"]["buckets"].keys() == x["at_k"]["buckets"].keys()  # torch.save(state) with a group


@pytest.mark.timeout(500)
def test_start_iter_sends_full_precision_first(w2: list[dict]) -> None:
    x = w2[0]["warmup"]
    for step in range(2):
        torch.testing.assert_close(x["runs"][step], x["plain"][step], rtol=1e-6, atol=1e-8)
        assert x["stats"][step].mean_bits == 32 and x["stats"][step].refusals == step + 1  # the warm-up, refused
    assert not torch.allclose(x["runs"][2], x["plain"][2], rtol=1e-3, atol=1e-6)
    assert x["stats"][2].mean_bits == (2 * 32 + 4) / 3 and x["stats"][2].refusals == 2


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", ["zero", "zero-ag"])
def test_signsgd_zero_bucket_stays_zero(w2: list[dict], case: str) -> None:
    for r in w2:
        assert torch.equal(r[case]["zero"], torch.zeros_like(r[case]["zero"]))
        after = r[case]["after"]  # a normal step: the vote's signs (ties +1), not all zero
        assert set(after.unique().tolist()) <= {-1.0, 0.0, 1.0} and after.abs().sum() > 0


@pytest.mark.timeout(200)
def test_world_size_1_passes_the_gradient_through() -> None:
    (r,) = spawn_local(hr.single, 1, ("qsgd-4bit",), timeout=30, deadline=150)
    assert r.ok, r.describe()
    assert torch.equal(r.value["hooked"], r.value["local"])
    s = r.value["stats"]
    assert s.bytes_sent == s.bytes_received == 0 and math.isnan(s.ratio) and s.steps == 1


def test_hook_state_validates() -> None:
    with pytest.raises(ValueError, match="unknown method|not a registered|method"):
        HookState(method="no-such-method")
    for kw, match in [({"seed": -1}, "seed"), ({"timeout": 0}, "timeout"), ({"timeout": math.inf}, "timeout"),
                      ({"total_steps": 0}, "total_steps"), ({"topology": "ring"}, "topology"),
                      ({"downlink_bits": 1}, "downlink_bits"), ({"downlink_bits": "fp16"}, "downlink_bits"),
                      ({"start_iter": -1}, "start_iter"), ({"min_compression_rate": -1}, "min_compression_rate")]:
        with pytest.raises(ValueError, match=match):
            HookState(**kw)
    with pytest.raises(TypeError, match="process_group"):
        HookState(process_group="world")  # type: ignore[arg-type]
    s = HookState(method=method_config("qsgd", bits=3))
    assert s.config.bits == 3 and math.isnan(s.compression_stats().ratio) and not hasattr(s, "__dict__")
    with pytest.raises(ValueError, match="state_dict"):
        s.load_state_dict({"version": 0})
    with pytest.raises(ValueError, match="method"):
        s.load_state_dict(HookState("dqsgd").state_dict())
