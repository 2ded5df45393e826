"""Adding a topology is one class and one registry line: a two-level one that exists only in the tests
(sharded inside groups of 2 ranks, the groups' updates averaged across groups, ``_hier_ranks.py``) runs
bitwise alike in the trainer's step over gloo, the simulation and the DDP hook, at W = 2 and 4."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

import _hier_ranks as hr
from dqsgd.cli.launch import spawn_local
from dqsgd.topology.registry import REGISTRY
from dqsgd.transport import SimTransport

pytestmark = pytest.mark.distributed
METHODS = ["qsgd-4bit", "dqsgd"]


@pytest.fixture(scope="module", autouse=True)
def registered() -> Iterator[None]:
    hr.register()
    yield
    REGISTRY.pop(hr.NAME)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_a_test_only_hierarchical_topology_runs_alike_in_trainer_simulation_and_hook(world: int) -> None:
    results = spawn_local(hr.hier_case, world, (METHODS,), timeout=60, deadline=240)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for method in METHODS:
        step, _ = hr.sharded_step(method, world)
        sim, bits = hr.run_steps(step, SimTransport(world, hr.NAME), list(range(world)))
        for r in results:
            got = r.value[method]
            assert got["bits"] == got["hook_bits"] == bits, (method, r.rank)
            for s in range(hr.STEPS):
                assert torch.equal(got["trainer"][s], sim[s]), (method, r.rank, s, "trainer")
                assert torch.equal(got["hook"][s], sim[s]), (method, r.rank, s, "hook")
        if world == 4:  # two groups: not the one-level sharded exchange
            flat, _ = hr.run_steps(hr.sharded_step(method, world, "sharded")[0], SimTransport(world, "sharded"),
                                   list(range(world)))
            assert not torch.equal(flat[0], sim[0]), method
