"""dqsgd.fsdp under real FSDP2 (``fully_shard``) on gloo processes, W = 2 and 4.

Against default FSDP (lossless method), against dqsgd's own sharded simulation (bitwise), the bytes
handed to the process group against the prediction, the budget, resume, and refusals.
"""

import pytest
import torch

import _fsdp_ranks as fr
from dqsgd.cli.launch import spawn_local
from dqsgd.fsdp import unit_seed
from dqsgd.fsdp.unit import ShardedMethod
from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.topology.agreement import SLOTS
from dqsgd.topology.refusal import ROOM
from dqsgd.topology.bucket import worker_generator
from dqsgd.topology.downspec import DownlinkSpec
from dqsgd.topology.step import FP32, ExchangeStep
from dqsgd.transport.sim import SimTransport

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LOSSLESS = {"min_compression_rate": 0.0}
W2 = [("sgd", LOSSLESS), ("qsgd-4bit", {}), ("dqsgd", {}), ("dqsgd-coded", {}), ("ef-signsgd", {}),
      ("terngrad", {})]
W4 = [("sgd", LOSSLESS), ("qsgd-4bit", {}), ("dqsgd", {})]


def _spawn(world: int, spec: list, extras: bool) -> list[dict]:
    results = spawn_local(fr.cases, world, (spec, extras), timeout=60, deadline=400)
    assert all(r.ok for r in results), [r.describe() for r in results]
    return [r.value for r in results]


@pytest.fixture(scope="module")
def w2() -> list[dict]:
    return _spawn(2, W2, True)


@pytest.fixture(scope="module")
def w4() -> list[dict]:
    return _spawn(4, W4, False)


def _worlds(w2, w4):
    return [(w2, [m for m, _ in W2]), (w4, [m for m, _ in W4])]


def _by_unit(run: dict) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for c in run["calls"]:
        out.setdefault(c["unit"], []).append(c)
    return out


def simulate(method: str, ranks: list[dict], unit: int) -> None:
    """Replay unit ``unit``'s reduce-scatters of every rank through ExchangeStep (downlink fp32) in one
    process; rank j's reduced shard must be bitwise shard j of the simulated update, the widths equal."""
    world = len(ranks)
    calls = [_by_unit(r)[unit] for r in ranks]
    numel = calls[0][0]["input"].numel()
    pieces = list(ranks[0]["pieces"][unit]) * world
    m = ShardedMethod(method_config(method), numel, fr.STEPS, pieces, world)
    step = ExchangeStep(m, pieces, world, unit_seed(fr.SEED, unit), DownlinkSpec(FP32))
    step.protocol.charge_side(scatter=True)  # the budget pays what FSDP's exchange sends beside the payloads
    state = m.init_state(world, step.protocol.policy)
    gens = {w: worker_generator(unit_seed(fr.SEED, unit), w) for w in range(world)}
    t = SimTransport(world, "sharded")
    n = numel // world
    for s in range(len(calls[0])):
        if calls[0][s]["bits"] is not None:
            assert [c[s]["bits"] for c in calls] == [state.bits] * world, f"{method} unit {unit} step {s}"
        ex = step.run(t, {w: calls[w][s]["input"].float() for w in range(world)}, state, s, gens)
        state = ex.state
        for j in range(world):
            assert torch.equal(calls[j][s]["output"], ex.update[j * n:(j + 1) * n]), f"{method} unit {unit} step {s}"


@pytest.mark.timeout(600)
def test_lossless_matches_default_fsdp(w2, w4) -> None:
    for ranks, _ in _worlds(w2, w4):
        for r in ranks:
            for got, want in zip(r["runs"]["sgd"]["params"], r["default"]):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
            s = r["runs"]["sgd"]["stats"]
            assert s.refusals == 0 and s.rounds == s.steps > 0  # every call went through the protocol
            assert s.downlink_sent == s.downlink_received == 0 and s.mean_bits == 32  # FSDP's all-gather: its own


@pytest.mark.timeout(600)
def test_reduced_shards_equal_sharded_simulation_bitwise(w2, w4) -> None:
    for ranks, methods in _worlds(w2, w4):
        for method in methods:
            runs = [r["runs"][method] for r in ranks]
            for unit in _by_unit(runs[0]):
                simulate(method, runs, unit)


@pytest.mark.timeout(600)
def test_bytes_handed_equal_counters_and_prediction(w2, w4) -> None:
    for ranks, methods in _worlds(w2, w4):
        world = len(ranks)
        for method in methods:
            for r in ranks:
                for c in r["runs"][method]["calls"]:
                    assert c["handed"] == c["counted"] > 0, (method, c["unit"])
        for r in ranks:  # fixed width: payload sizes known in advance
            seen = set()
            for c in r["runs"]["qsgd-4bit"]["calls"]:
                shard = Method(method_config("qsgd-4bit"), c["output"].numel(), fr.STEPS).message_bits(4) // 8
                agree = 0 if c["unit"] in seen else (world - 1) * (2 + SLOTS) * 8  # the first call compares configs
                seen.add(c["unit"])
                status = (world - 1) * (ROOM + 1)  # the all-gather of the status messages
                assert c["handed"] == (world - 1) * (shard + 1) + status + agree  # each payload with its flag byte


@pytest.mark.timeout(600)
def test_budget_never_overspent(w2) -> None:
    """The bit budget (dqsgd: arithmetic, every step) and the byte budget (dqsgd-coded: by its reserve's
    margin, over 40 steps of a 16 640-element unit) hold for the bits each rank really sent."""
    for r in w2:
        run = r["runs"]["dqsgd"]
        for unit, spent in run["spent"].items():
            assert len(spent) == fr.STEPS and sum(spent) <= run["budget"][unit], (unit, spent)
        coded = {u: v for u, v in r["coded_budget"].items() if v[0]}
        assert list(coded) == [1]  # the root's 257 elements go exact (min_numel)
        for unit, (spent, budget) in coded.items():
            assert len(spent) == fr.CODED_STEPS and 0.9 * budget <= sum(spent) <= budget, (unit, sum(spent), budget)


@pytest.mark.timeout(600)
def test_save_load_resumes_bitwise(w2) -> None:
    for method, res in w2[0]["resume"].items():
        for r in w2:
            for a, b in zip(r["resume"][method]["straight"], r["resume"][method]["resumed"]):
                assert torch.equal(a, b), method


@pytest.mark.timeout(600)
def test_refusals_on_every_rank(w2) -> None:
    errors = [r["refusals"] for r in w2]
    assert all(e["config"].startswith("RankDisagreement: dqsgd.fsdp.compress: ") and "the ranks run different configurations: "
               "method.bits (rank(s) [1] differ from rank 0" in e["config"] for e in errors), errors
    assert all(e["forged"].startswith("PayloadError: FSDP unit ") and "rank 1" in e["forged"]
               and "refused before allocating" in e["forged"] for e in errors), errors
    assert all(e["corrupt"].startswith("PayloadError: FSDP unit ") and "refused a payload it received" in e["corrupt"]
               for e in errors), errors


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_a_payload_one_rank_refuses_stops_every_rank_promptly(world: int) -> None:
    """Rank W−1 damages its payload for rank 0 alone (body, then header); every rank raises rank 0's
    error, its type and text carried in the exchange's status messages, within seconds, far below the
    60 s collective timeout the ranks would otherwise wait out."""
    results = spawn_local(fr.lone_refusals, world, (60.0,), timeout=120, deadline=250)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for name in ("corrupt", "header"):
        for rank, r in enumerate(results):
            err, seconds = r.value[name]
            kind, _, text = err.partition(": ")
            assert kind in ("PayloadError", "ProtocolError") and text.startswith("FSDP unit "), (name, rank, err)
            assert f"rank {rank}: step " in text and "rank 0 refused a payload it received: " in err, (name, rank, err)
            assert len(err) > 90 and seconds < 20.0, (name, rank, seconds, err)


@pytest.mark.timeout(300)
def test_a_nonfinite_gradient_gives_nan_everywhere_and_keeps_the_residuals() -> None:
    """One rank's NaN (an AMP overflow): every rank's reduced shards are NaN (as FSDP's own sum gives,
    so a GradScaler skips the step) and no error-feedback residual takes the skipped step in."""
    results = spawn_local(fr.nonfinite, 2, (), timeout=60, deadline=250)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for r in results:
        assert all(g.numel() and torch.isnan(g).all() for g in r.value["grads"]), r.value["grads"]
        assert r.value["kept"] and all(r.value["kept"].values()), r.value["kept"]
