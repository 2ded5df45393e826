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


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("world", [2, 4])
def test_the_topologys_traffic_count_is_the_bytes_its_collectives_move(world: int, method: str) -> None:
    """The bytes each rank's collectives move (counted on the group, every collective of the step)
    are what the topology's legs say, the all-gather of the groups' updates included: per rank and
    phase from the trainer's step outcome (its table and downlink sizes, which the trainer's wire
    traffic reads, framed as sent), and summed over the ranks as the exchange counts them for the
    hook (its ``count``)."""
    from dqsgd.topology.exchange import Exchange
    from dqsgd.topology.group import local_groups
    from dqsgd.topology.bucket import worker_generator
    from dqsgd.topology.registry import topology_of
    from dqsgd.topology.state import BucketState, Memory

    step, _ = hr.sharded_step(method, world)
    state, kind = step.method.init_state(world, step.policy), topology_of(hr.NAME)
    for s in range(hr.STEPS):
        books = {w: {0: [0, 0], 1: [0, 0]} for w in range(world)}
        t = SimTransport(world, hr.NAME)
        t.exchange_groups = lambda: {w: hr.Counting(g, books[w]) for w, g in enumerate(local_groups(world))}
        out = step.run(t, {w: hr.grad(w, s) for w in range(world)}, state, s,
                       {w: worker_generator(hr.SEED, w) for w in range(world)})
        state, shards = out.state, len(out.up[0])
        assert len(out.up) == world and out.down[shards:] == [4 * hr.N] * (world // hr.GROUP - 1)  # the other
        # groups' float32 updates; as sent: each payload with its flag byte, each downlink padded to the
        # longest, with its status byte
        up, down = [[n + 1 for n in row] for row in out.up], [max(out.down[:shards]) + 1] * shards + out.down[shards:]
        for w, book in books.items():
            legs = kind.legs(up, down, w)
            assert list(legs) == [*book[0], *book[1]], (s, w, legs, book)

    counted = [0, 0, 0, 0]

    def count(legs: tuple, whole: bool) -> None:
        for i, n in enumerate(legs):
            counted[i] += n

    b = BucketState(numel=hr.N, proto=step.protocol, policy=step.policy.init(), step=0)
    books = {w: {0: [0, 0], 1: [0, 0]} for w in range(world)}
    groups = [hr.Counting(g, books[w]) for w, g in enumerate(local_groups(world))]
    Exchange(b, count=count).start({w: (hr.grad(w, 0), groups[w], Memory()) for w in range(world)})
    assert counted == [sum(bk[leg][i] for bk in books.values()) for leg in (0, 1) for i in (0, 1)]


@pytest.mark.parametrize("method", ["qsgd-4bit", "terngrad"])  # sizes known; sizes exchanged (and scalers)
def test_the_trainer_runs_it_and_its_ledger_counts_every_rank_and_the_groups_updates(method: str) -> None:
    """``dqsgd train``'s trainer with the test-only topology at W = 4 (two groups): one ledger row per
    worker (the groups' tables gathered), and each rank's downlink bytes hold the other group's update."""
    from dqsgd.data import load_dataset
    from dqsgd.train.config import load_experiment
    from dqsgd.train.trainer import Trainer

    exp = load_experiment("table1-fashion", ["train.workers=4", f"train.topology={hr.NAME}", "train.steps=2"])
    tr = Trainer(exp.train, next(e for e in exp.methods if e.label == method), load_dataset(exp.train.dataset), 0)
    tr.step()
    rec = tr.ledger.records[-1]
    assert len(rec.up_bytes) == len(rec.rank_up) == len(rec.rank_down) == 4 and min(rec.up_bytes) > 0
    assert min(rec.rank_down) > 4 * tr.numel  # the other group's float32 update, and the shards' downlink
