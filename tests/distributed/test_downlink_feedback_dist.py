"""The error-fed downlink is one engine too: a 2-bit error-fed sharded downlink gives bitwise the
same parameters in the simulation, in the trainer over gloo and in DDP with the hook (2 ranks), and
each rank's shard server residual is the simulation's for that shard."""

from __future__ import annotations

import pytest
import torch

import _engine_ranks as er
import _feedback_ranks as fr
from dqsgd.cli.launch import spawn_local

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    results = spawn_local(fr.fed, 2, (), timeout=60, deadline=400)
    bad = [r for r in results if not r.ok]
    assert not bad, bad[0].error
    return [r.value for r in results]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("method", fr.METHODS)
def test_fed_downlink_simulation_trainer_and_hook_agree_bitwise(ranks: list[dict], method: str) -> None:
    sim, _ = er.run_trainer(method, "sharded", None, 2, downlink_bits=fr.DOWN, downlink_feedback=True)
    sim_params = torch.cat([p.detach().reshape(-1) for p in sim.params])
    assert sorted(sim.state.down_residuals) == [0, 1]  # the simulation serves both shards
    for rank, r in enumerate(ranks):
        got = r[method]
        for name in ("trainer_params", "hook_params"):
            assert torch.equal(got[name].view(torch.int32), sim_params.view(torch.int32)), (rank, name)
        assert got["trainer_bits"] == [x.bits for x in sim.ledger.records]
        assert list(got["trainer_down"]) == [rank]  # rank j serves (and keeps the residual of) shard j
        res = got["trainer_down"][rank]
        assert res.abs().max() > 0 and torch.equal(res.view(torch.int32), sim.state.down_residuals[rank].view(torch.int32))
