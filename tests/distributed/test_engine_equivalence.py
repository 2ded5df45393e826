"""One engine: DDP with the dqsgd hook, the trainer over the torch transport and the simulation give the
same payload bytes, the same widths every step and bitwise-equal parameters (2 and 4 gloo ranks;
qsgd-4bit, dqsgd, signSGD's vote and TernGrad; topologies sharded and allgather). dqsgd on sharded runs
its default ``downlink_bits = "auto"``: the hook and the trainer choose the same downlink widths too."""

from __future__ import annotations

import pytest
import torch

import _engine_ranks as er
from dqsgd.cli.launch import spawn_local

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
CASES = er.CASES


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    results = spawn_local(er.engines, request.param, (), timeout=60, deadline=500)
    bad = [r for r in results if not r.ok]
    assert not bad, bad[0].error
    return request.param, [r.value for r in results]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("method,topology", CASES)
def test_hook_trainer_and_simulation_are_one_engine(world: tuple[int, list[dict]], method: str,
                                                    topology: str) -> None:
    W, ranks = world
    sim, _ = er.run_trainer(method, topology, None, W)
    sim_params = torch.cat([p.detach().reshape(-1) for p in sim.params])
    sim_bits = [r.bits for r in sim.ledger.records]
    sim_down = [r.down_bytes for r in sim.ledger.records]  # dqsgd on sharded: both widths from one budget
    for rank, r in enumerate(ranks):
        got = r[f"{method}/{topology}"]
        trainer, hook = got["trainer_rows"], got["hook_rows"]
        assert len(trainer) == len(hook) == er.STEPS
        for step, ((tb, trow), (hb, hrow)) in enumerate(zip(trainer, hook)):
            assert tb == hb, (rank, step, "widths differ")
            assert trow == hrow, (rank, step, "payload bytes differ")
        assert [b for b, _ in trainer] == got["trainer_bits"] == sim_bits
        assert got["trainer_down"] == got["hook_down"], (rank, "downlink widths differ")
        assert got["trainer_down_payloads"] == got["hook_down_payloads"], (rank, "downlink payloads differ")
        assert got["trainer_down_bytes"] == sim_down, (rank, "downlink bytes differ from the simulation's")
        for name in ("trainer_params", "hook_params"):
            assert torch.equal(got[name].view(torch.int32), sim_params.view(torch.int32)), (rank, name)
    if method.startswith("dqsgd") and topology == "sharded":  # downlink_bits "auto" by default
        assert sim.downlink_bits == "auto"
    if method == "dqsgd-coded":  # its downlink is entropy-coded: smaller than the fixed payload of its width
        proto, got0 = sim.step_runner.protocol, ranks[0][f"{method}/{topology}"]  # rank 0 serves shard 0
        assert proto.coded_down
        sent = [len(p) for p in got0["hook_down_payloads"]]
        fixed = [proto.down_sizes(v)[0] for v in got0["hook_down"]]
        assert all(a <= b for a, b in zip(sent, fixed)) and sum(sent) < sum(fixed), (sent, fixed)
    if method == "dqsgd-t3":  # the pair of widths really moves
        pairs = set(zip(sim_bits, ranks[0][f"{method}/{topology}"]["hook_down"]))
        assert len(pairs) > 1, pairs
    elif method == "dqsgd" and topology == "allgather":
        assert len(set(sim_bits)) > 1, sim_bits  # the widths really move
