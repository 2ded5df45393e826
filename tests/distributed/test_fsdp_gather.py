"""The quantized parameter all-gather (``FSDPState(param_bits=...)``) under real FSDP2 on gloo, W = 2 and 4.

Lossless (32 bits) against default FSDP bitwise, in fp32 and in bf16 mixed precision; at 8 and 4 bits
every dequantized chunk the forward and backward see within the quantizer's bound of the owner's
chunk, the same on every rank, and the owner's shard updated in full precision; the bytes against
the payload bound; forged payloads refused on every rank within seconds.
"""

import math

import pytest
import torch

import _fsdp_gather_ranks as gr
from dqsgd.cli.launch import spawn_local
from dqsgd.fsdp.gather import HEADER, param_bound, payload_cap

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BLOCK = 16
F32_SLACK = 2.0 ** -20  # float32 arithmetic of a = |x|·(s/r) and of r·q/s: at most 4·2^-24 of r (docs/fsdp.md)
BF16_SLACK = 2.0 ** -8  # the bf16 output's rounding of a value of magnitude ≤ r: at most 2^-8·r


def _spawn(world: int, extras: bool) -> list[dict]:
    results = spawn_local(gr.cases, world, (extras,), timeout=60, deadline=500)
    assert all(r.ok for r in results), [r.describe() for r in results]
    return [r.value for r in results]


@pytest.fixture(scope="module")
def w2() -> list[dict]:
    return _spawn(2, True)


@pytest.fixture(scope="module")
def w4() -> list[dict]:
    return _spawn(4, False)


def _check_bound(ranks: list[dict], case: str, bits: int, rounding: str, slack: float) -> None:
    """Chunk w of every rank's output at call c is within the bound of rank w's input at call c."""
    world = len(ranks)
    calls = [r[case]["calls"] for r in ranks]
    assert len({len(c) for c in calls}) == 1 and calls[0]
    moved = False
    for c in range(len(calls[0])):
        outs = [calls[r][c]["output"].view(world, -1) for r in range(world)]
        assert all(torch.equal(o, outs[0]) for o in outs), (case, c)  # every rank computes with the same weights
        for w in range(world):
            x = calls[w][c]["input"]
            pad = (-x.numel()) % BLOCK
            blocks = torch.cat([x, x.new_zeros(pad)]).view(-1, BLOCK)
            r = blocks.abs().amax(dim=1, keepdim=True).expand_as(blocks).reshape(-1)[: x.numel()]
            bound = param_bound(r, bits, rounding) + slack * r
            err = (outs[0][w] - x).abs()
            assert bool((err <= bound).all()), (case, c, w, float((err - bound).max()))
            moved |= not torch.equal(outs[0][w], x)
    assert moved, case  # the chunks were quantized, not passed through


@pytest.mark.timeout(900)
def test_lossless_all_gather_equals_default_fsdp_bitwise(w2, w4) -> None:
    for ranks in (w2, w4):
        for r in ranks:
            assert all(torch.equal(a, b) for a, b in zip(r["lossless"]["params"], r["default"]["params"]))
            assert r["lossless"]["stats"]["param_calls"] == len(r["lossless"]["calls"]) > 0
            for case in ("lossless", "q8", "q4"):  # one collective per all-gather: no size exchange, no relay
                assert all(c["collectives"] == ["all_gather"] for c in r[case]["calls"]), case
    for r in w2:  # bf16 mixed precision composes: the same weights as FSDP's own bf16 all-gather
        assert all(torch.equal(a, b) for a, b in zip(r["bf16_lossless"]["params"], r["bf16_default"]["params"]))
        assert all(c["dtype"] == "torch.bfloat16" for c in r["bf16_lossless"]["calls"])


@pytest.mark.timeout(900)
def test_the_forward_sees_weights_within_the_quantizer_bound(w2, w4) -> None:
    for ranks in (w2, w4):
        _check_bound(ranks, "q8", 8, "nearest", F32_SLACK)
        _check_bound(ranks, "q4", 4, "nearest", F32_SLACK)
    _check_bound(w2, "q8s", 8, "stochastic", F32_SLACK)
    _check_bound(w2, "bf16_q8", 8, "nearest", F32_SLACK + BF16_SLACK)
    for a, b in zip(w2, w2):  # stochastic rounding is seeded: a rerun is bitwise the same
        assert all(torch.equal(x, y) for x, y in zip(a["q8s"]["params"], b["q8s_again"]["params"]))


@pytest.mark.timeout(900)
def test_the_owner_updates_its_full_precision_shard(w2, w4) -> None:
    """The sharded parameters stay float32 and each SGD step is p − lr·g of the previous full-precision
    shard (bitwise), and the all-gather's input is that shard, not a dequantized copy."""
    for ranks in (w2, w4):
        world = len(ranks)
        for r in ranks:
            run = r["q8"]
            assert run["dtypes"] == ["torch.float32"] * 4
            log = run["log"] + [{"before": run["params"]}]
            for s in range(gr.STEPS):
                for p0, g, p1 in zip(log[s]["before"], log[s]["grads"], log[s + 1]["before"]):
                    assert torch.equal(p1, p0.add(g, alpha=-gr.LR)), s
            for c in run["calls"]:
                units = [(0, 1), (2, 3)][c["unit"]]
                at, x = 0, c["input"]
                for i in units:
                    local = log[c["step"]]["before"][i].reshape(-1)
                    shape = run["shapes"][i]
                    assert torch.equal(x[at: at + local.numel()], local), c["step"]
                    at += math.ceil(shape[0] / world) * math.prod(shape[1:])
                assert at == x.numel()


@pytest.mark.timeout(900)
def test_bytes_handed_equal_the_payload_bound(w2, w4) -> None:
    for ranks in (w2, w4):
        world = len(ranks)
        for r in ranks:
            for case, bits in (("lossless", 32), ("q8", 8), ("q4", 4)):
                calls, st = r[case]["calls"], r[case]["stats"]
                sizes = [c["input"].numel() for c in calls]
                assert st["fp32_ag_bytes"] == sum((world - 1) * 4 * n for n in sizes)
                assert st["param_bytes_sent"] == sum((world - 1) * payload_cap(n, bits, BLOCK) for n in sizes), case
                assert st["param_side_bytes"] == (world - 1) * HEADER.size * len(sizes), case  # the frames' headers
            assert r["q4"]["stats"]["param_bytes_sent"] < r["q8"]["stats"]["param_bytes_sent"] < r["q8"]["stats"][
                "fp32_ag_bytes"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4])
def test_a_forged_parameter_payload_stops_every_rank_promptly(world: int) -> None:
    """Rank W−1 forges its payload: past the cap, at another width, with a flipped byte, or sends the
    non-finite shard's refusal; every rank raises an error naming it within seconds, far below the 60 s
    collective timeout, from the one all-gather's bytes (no rank relays a verdict)."""
    results = spawn_local(gr.forged, world, (60.0,), timeout=120, deadline=350)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for rank, r in enumerate(results):
        err, seconds = r.value["oversize"]
        assert err.startswith(f"PayloadError: rank {rank}: FSDP unit 0 parameter all-gather: rank {world - 1} "
                              "announced a payload of "), err
        assert "refused before allocating" in err and seconds < 20.0, (err, seconds)
        for name in ("width", "corrupt"):
            err, seconds = r.value[name]
            assert err.startswith(f"PayloadError: rank {rank}: FSDP unit 0 parameter all-gather 0: every rank refuses "
                                  f"the payload of rank {world - 1}: "), (name, err)
            assert seconds < 20.0, (name, err, seconds)
        assert "expected UNIFORM of" in r.value["width"][0], r.value["width"][0]
        err, seconds = r.value["nonfinite"]
        assert err == (f"ValueError: rank {rank}: FSDP unit 0 parameter all-gather 0: the parameter shard of rank(s) "
                       f"[{world - 1}] holds NaN or Inf; nothing was gathered") and seconds < 20.0, (err, seconds)


@pytest.mark.timeout(900)
def test_a_resumed_stochastic_run_draws_the_same_roundings(w2) -> None:
    """The all-gathers' count is in FSDPState.state_dict: resumed after step 0, the stochastic 8-bit
    run ends with the uninterrupted run's parameters, bitwise (on the old code the counter restarted at 0)."""
    for r in w2:
        saved = r["q8s_resumed"]["saved"]
        assert saved and set(saved.values()) == {2}, saved  # each unit's gathers of step 0: forward and backward
        for a, b in zip(r["q8s_resumed"]["params"], r["q8s"]["params"]):
            assert torch.equal(a, b)
