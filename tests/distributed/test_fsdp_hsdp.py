"""HSDP with a compressed replicate leg (``dqsgd.fsdp.compress(model, state, replicate=HookState)``)
under real FSDP2 on gloo: 4 processes as 2 nodes × 2 ranks, and 2 as 2 nodes × 1 rank.

Lossless against FSDP's own HSDP (bitwise), the compressed leg against the bucket protocol run in one
process over the replica group (the sharded simulation, bitwise), forged messages and configurations
that disagree refused on every rank.
"""

import pytest
import torch

import _hsdp_ranks as hr
from dqsgd.cli.launch import spawn_local
from dqsgd.ddp import HookState
from dqsgd.method.config import method_config
from dqsgd.topology.bucket import BucketProtocol
from dqsgd.topology.exchange import in_process

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GRIDS = [(2, 2), (2, 1)]  # (nodes R, ranks per node S)


@pytest.fixture(scope="module", params=GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def grid(request) -> tuple[tuple[int, int], list[dict]]:
    R, S = request.param
    results = spawn_local(hr.cases, R * S, (R, S), timeout=60, deadline=600)
    assert all(r.ok for r in results), [r.describe() for r in results]
    return (R, S), [r.value for r in results]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.timeout(900)
def test_lossless_replicate_leg_equals_fsdp_hsdp_bitwise(grid) -> None:
    """Method sgd with an fp32 downlink through the hook's protocol (min_compression_rate 0, so no
    bucket falls back to a plain all-reduce): rank j of the replica group averages its shard as
    g_0/2 + g_1/2, FSDP's AVG all-reduce as (g_0 + g_1)/2; for R = 2 both are the exact sum scaled by
    a power of two, so the parameters after every step are FSDP's own bit for bit, on the 2-D mesh
    and on the 1-D shard mesh with the replica group beside it."""
    (R, S), ranks = grid
    for r in ranks:
        for case in ("lossless_2d", "lossless_1d"):
            assert _same(r[case]["params"], r["native"]["params"]), case
            s = r[case]["stats"]
            assert s.refusals == 0 and s.steps == hr.STEPS and s.mean_bits == 32, case  # through the protocol
            assert len(r[case]["calls"]) == 2 * hr.STEPS  # both units, every step
        assert not _same(r["q4_2d"]["params"], r["native"]["params"])  # the compressed leg changes them
        # set_gradient_divide_factor(f): FSDP sums across the replicas (the leg's mean times R), divides by f once
        assert _same(r["lossless_factor"]["params"], r["native_factor"]["params"])
        assert not _same(r["native_factor"]["params"], r["native"]["params"])
        # warm-up (start_iter): the hook's plain all-reduce, in place in FSDP's shard, is FSDP's own all-reduce
        assert _same(r["warmup"]["params"], r["native"]["params"]) and r["warmup"]["stats"].refusals == 2 * hr.STEPS
        # a model whose one unit is the root, reduced in FSDP's end-of-backward callback
        assert _same(r["lossless_root"]["params"], r["native_root"]["params"])
        assert len(r["lossless_root"]["calls"]) == hr.STEPS and r["lossless_root"]["stats"].steps == hr.STEPS


def _reference(calls: list[list[dict]], s: int, R: int, down: object) -> torch.Tensor:
    """Call s of the replica group's ranks through BucketProtocol in one process (the simulation)."""
    c0 = calls[0][s]
    n = c0["input"].numel()
    cfg = method_config("qsgd-4bit")
    dbits = HookState(cfg, downlink_bits=down).downlink_bits
    proto = BucketProtocol(cfg, n, list(c0["pieces"]), topology="sharded", workers=R, seed=hr.SEED, bucket=c0["unit"],
                           total_steps=hr.STEPS, downlink_bits=dbits)
    return in_process(proto, [c[s]["input"].float() for c in calls], 4, s // 2)


@pytest.mark.timeout(900)
def test_compressed_leg_equals_the_sharded_simulation_bitwise(grid) -> None:
    """qsgd-4bit over the replica group (8-bit and fp32 downlinks, 2-D and 1-D meshes): every rank's
    leg output is the bucket protocol's update for the replicas' inputs (unit u = bucket u, its padded
    shard pieces the parameters), the same on every replica; unit u's step s is hook step s."""
    (R, S), ranks = grid
    for case, down in (("q4_2d", None), ("q4_1d", None), ("q4_fp32down", "fp32")):
        for pos in range(S):  # the replica group of position pos: ranks pos, S + pos, ...
            group = [ranks[node * S + pos] for node in range(R)]
            assert [g[case]["replica"] for g in group] == list(range(R))
            calls = [g[case]["calls"] for g in group]
            assert len(calls[0]) == 2 * hr.STEPS and all(c["bits"] == 4 for c in calls[0])
            for s in range(len(calls[0])):
                want = _reference(calls, s, R, down)
                for c in calls:
                    assert torch.equal(c[s]["output"], want.reshape(c[s]["output"].shape)), (case, pos, s)
                    assert not torch.equal(c[s]["output"], c[s]["input"])


@pytest.mark.timeout(900)
def test_the_overlapped_leg_equals_the_waiting_leg_bitwise(grid) -> None:
    """The replicate legs left in flight while the backward goes on (every unit but unit 0, which FSDP
    reduces last and which waits for them) give the gradients — hence every leg's output and the
    parameters after every step — of legs that each wait for their result, bit for bit (qsgd-4bit on
    the 2-D mesh, dqsgd's dynamic policy on the 1-D one); where FSDP divides the shard after the hook (a
    gradient divide factor) every leg waits."""
    (R, S), ranks = grid
    for r in ranks:
        for case in ("q4_2d", "dqsgd_1d"):
            on, off = r[case], r[f"{case}_waiting"]
            assert len(on["calls"]) == 2 * hr.STEPS, case
            assert [c["deferred"] for c in on["calls"]] == [c["unit"] != 0 for c in on["calls"]], case
            assert not any(c["deferred"] for c in off["calls"]), case
            assert _same(on["params"], off["params"]), case
            assert _same([c["output"] for c in on["calls"]], [c["output"] for c in off["calls"]]), case
            assert _same([c["input"] for c in on["calls"]], [c["input"] for c in off["calls"]]), case
        assert not any(c["deferred"] for c in r["lossless_factor"]["calls"])


@pytest.mark.timeout(900)
def test_both_legs_compressed(grid) -> None:
    """The intra-node reduce-scatter and all-gather compressed too (FSDPState beside the replicate
    HookState): the replicas end with the same parameters, which differ from FSDP's own."""
    (R, S), ranks = grid
    for pos in range(S):
        group = [ranks[node * S + pos]["both"]["params"] for node in range(R)]
        assert all(_same(p, group[0]) for p in group)
        assert not _same(group[0], ranks[pos]["native"]["params"])
    for r in ranks:  # each node's reduce-scatter draws its own roundings (unit_seed of its replica index)
        assert r["both"]["state_replica"] == r["both"]["replica"] == r["rs_lossless_2d"]["state_replica"]


@pytest.mark.timeout(900)
def test_compressed_reduce_scatter_beside_fsdps_own_all_reduce(grid) -> None:
    """A 2-D mesh with dqsgd's reduce-scatter inside the node and FSDP's own all-reduce across nodes
    (no replicate leg): lossless (sgd through the protocol), it is FSDP's HSDP bit for bit for S ≤ 2
    (the protocol's g_0/2 + g_1/2 against gloo's (g_0 + g_1)/2, both the exact sum halved)."""
    (R, S), ranks = grid
    for r in ranks:
        assert _same(r["rs_lossless_2d"]["params"], r["native"]["params"])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("R,S", GRIDS)
def test_a_forged_replicate_message_stops_every_rank_promptly(R: int, S: int) -> None:
    """The last rank flips a header byte, then a body byte, of every message it sends on the replicate
    leg: every rank raises a PayloadError (or ProtocolError) saying that a shard server refused a
    payload, within seconds, far below the 60 s collective timeout."""
    results = spawn_local(hr.forged, R * S, (R, S, 60.0), timeout=120, deadline=350)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for r in results:
        for name in ("header", "body"):
            err, seconds = r.value[name]
            assert err.split(":")[0] in ("PayloadError", "ProtocolError"), (name, err)
            assert "refused a payload" in err and seconds < 20.0, (name, err, seconds)


@pytest.mark.timeout(400)
def test_disagreeing_configurations_are_refused_on_every_rank() -> None:
    R, S = 2, 2
    results = spawn_local(hr.disagree, R * S, (R, S), timeout=60, deadline=300)
    assert all(r.ok for r in results), [r.describe() for r in results]
    last_node = range((R - 1) * S, R * S)
    for rank, r in enumerate(results):
        for name, field in (("method", "replicate.method.name"), ("seed", "replicate.seed"), ("fsdp_seed", "seed")):
            err = r.value[name]
            assert err.startswith("RankDisagreement: dqsgd.fsdp.compress: "), (name, err)
            if rank in last_node:  # its node compared the fields and names them
                assert field in err, (name, err)
            else:  # the other node learns that the last node refused
                assert "refused to start" in err, (name, err)
        assert r.value["group"].startswith("ValueError: FSDP unit 0: the replica group "), r.value["group"]


@pytest.mark.timeout(400)
def test_a_backward_that_fails_on_one_rank_with_legs_in_flight_stops_every_rank() -> None:
    """2 nodes × 2 ranks, the overlapped replicate leg: rank 3's backward raises after unit 1's legs
    are in flight, and rank 3 stays alive without sending for 4 × the 10 s timeout. Rank 3 raises its
    own error; ranks 0 and 1, whose replicate legs of unit 0 never get rank 2's and rank 3's
    messages, wait for the legs left in flight, then raise within the hook's timeout (well before rank
    3 leaves) a TransportError saying which rank's exchange failed, not that a payload was refused;
    rank 2, in FSDP's own reduce-scatter with rank 3, raises too. Nothing hangs."""
    R, S, timeout = 2, 2, 10.0
    results = spawn_local(hr.failed_backward, R * S, (R, S, timeout), timeout=60, deadline=300)
    assert all(r.ok for r in results), [r.describe() for r in results]
    (e0, t0), (e1, t1), (e2, _), (e3, t3) = (r.value for r in results)
    assert e3 == "RuntimeError: injected failure" and t3 < timeout, (e3, t3)
    for err, seconds in ((e0, t0), (e1, t1)):
        assert err.startswith("TransportError: rank ") and "FSDP unit 0, replicate leg 1" in err, err
        assert "(and the legs of units [1] in flight)" in err and "'s exchange failed: " in err, err
        assert "refused a payload" not in err and "completed steps" not in err, err  # FSDP's steps: not counted
        assert seconds < 3 * timeout, (err, seconds)
    assert e2, "rank 2 returned from a backward whose reduce-scatter peer had failed"
