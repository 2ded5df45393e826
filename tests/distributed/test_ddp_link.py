"""The link policy (``dqsgd-link``) through the DDP hook on 2 and 4 gloo processes.

Every rank's ‖g‖² and realized rounding error ride in the bucket's size exchange, so every rank folds
the same σ̂² and picks the same next width: checked bitwise across ranks, and against the same
exchange run in one process on the ranks' local buckets (the simulation's exchange). On a link fast
against the codec the policy sends the bucket uncompressed (a plain all-reduce: the dtype's bytes, or
fp16's with ``uncompressed_dtype``); on a slow one it compresses.
"""

import pytest
import torch

import _engine_ranks as er
import _link_ranks as lr
from dqsgd.cli.launch import spawn_local
from dqsgd.ddp import HookState
from dqsgd.method.config import MethodConfig, method_config
from dqsgd.policies.link import DEFAULT_CODEC_NS
from dqsgd.policies.linktime import UNCOMPRESSED
from dqsgd.topology.exchange import Exchange
from dqsgd.topology.group import local_groups
from dqsgd.topology.bucket import worker_generator
from dqsgd.topology.registry import ring_bytes
from dqsgd.topology.state import BucketState, Memory

pytestmark = pytest.mark.distributed

SLOW, FAST = {"method": {"link_mbit": 1.0}}, {"method": {"link_mbit": 1e5}}
CASES = {2: {"slow": SLOW, "slow-ag": {**SLOW, "topology": "allgather"}, "fast": FAST,
             "fast16": {**FAST, "uncompressed_dtype": "float16"}},
         4: {"slow": SLOW, "fast": FAST}}


# Opt-in: dqsgd-link with link_mbit 0 (the link measured); the default dqsgd (the stated budget) beside the
# budget config that "dqsgd" has always been (its preset's fields, under another name).
BEFORE = MethodConfig(name="dqsgd-before", scheme="uniform", bits=6, policy="dqsgd-budget", target_bits=4.5)
OTHERS = {"measured": {"method": {"link_mbit": 0.0}}, "budget": {"name": "dqsgd"}, "before": {"config": BEFORE}}


@pytest.fixture(scope="module", params=[2, 4])
def runs(request) -> tuple[int, list[dict]]:
    world = request.param
    results = spawn_local(lr.link_cases, world, (CASES[world], OTHERS if world == 2 else None), timeout=120,
                          deadline=500)
    assert all(r.ok for r in results), [r.describe() for r in results]
    return world, [r.value for r in results]


def replay(world: int, kw: dict, per_rank: list[list]) -> list[tuple]:
    """The hook's bucket protocol and policy run by the exchange in one process on the ranks' local
    buckets, step by step as the hook does: the policy state and the update after each step."""
    kw = dict(kw)
    state = HookState(method_config("dqsgd-link", **kw.pop("method", {})), seed=3, total_steps=20, **kw)
    _, local, sizes, _ = per_rank[0][0]
    n = local.numel()
    proto = state.protocol(0, n, sizes, world, local.dtype)
    b = BucketState(numel=n, proto=proto, policy=proto.policy.init(), generator=worker_generator(3, 0, 0),
                    sizes=tuple(sizes))
    mems = [b] + [Memory(generator=worker_generator(3, r, 0)) for r in range(1, world)]
    groups, out = local_groups(world), []
    for s in range(lr.STEPS):
        b.prepare(torch.device("cpu"))
        assert b.bits != UNCOMPRESSED
        futures = Exchange(b).start({r: (per_rank[r][s][1], groups[r], mems[r]) for r in range(world)})
        update = groups[0].wait(futures[0]).update
        out.append((repr(b.policy), update.reshape(local.shape)))
    return out


@pytest.mark.timeout(600)
def test_every_rank_folds_the_same_sigma2_and_picks_the_same_width(runs) -> None:
    world, values = runs
    for name in CASES[world]:
        per = [v[name] for v in values]
        assert all([repr(p) for p in r["policy"]] == [repr(p) for p in per[0]["policy"]] for r in per), name
        for s in range(lr.STEPS):
            assert all(torch.equal(r["buckets"][s][3], per[0]["buckets"][s][3]) for r in per), (name, s)
        later = per[0]["policy"][-1]
        assert later.workers == world and later.sigma2 > 0, (name, later)  # fed: σ̂² known, W workers


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["slow", "slow-ag"])
def test_the_hook_equals_the_exchange_run_in_one_process(runs, name: str) -> None:
    """Where the inputs are equal (the ranks' local buckets) the hook's policy states — σ̂², widths,
    objective, bit for bit — and updates are the one-process exchange's."""
    world, values = runs
    if name not in CASES[world]:
        pytest.skip(f"{name} runs at W = 2 only")
    per = [v[name]["buckets"] for v in values]
    ref = replay(world, CASES[world][name], per)
    assert [repr(p) for p in values[0][name]["policy"]] == [p for p, _ in ref]
    for s, (_, update) in enumerate(ref):
        assert torch.equal(per[0][s][3], update), s


@pytest.mark.timeout(600)
def test_a_fast_link_sends_uncompressed_a_slow_one_compresses(runs) -> None:
    """Step 0 runs at the start width (no σ̂² yet); from step 1 on a 100 Gbit/s link (the codec's
    nanoseconds per coordinate cost more than fp32's wire time) every bucket is all-reduced in its
    dtype: exactly the ring's bytes of n·4 (fp16: n·2); at 1 Mbit/s every step compresses."""
    world, values = runs
    for v in values:
        n = v["fast"]["buckets"][0][1].numel()
        for name, itemsize in (("fast", 4), ("fast16", 2)):
            if name not in v:
                continue
            run = v[name]
            assert run["bits"][0] == {0: 4} and all(b == {0: UNCOMPRESSED} for b in run["bits"][1:]), run["bits"]
            assert run["sent"][1:] == [ring_bytes(n * itemsize, world)] * (lr.STEPS - 1), run["sent"]
            assert run["sent"][0] < ring_bytes(n * 4, world)
        slow = v["slow"]
        assert all(2 <= b[0] <= 8 for b in slow["bits"]), slow["bits"]
        assert all(0 < s < ring_bytes(n * 4, world) / 3 for s in slow["sent"]), slow["sent"]


@pytest.mark.timeout(600)
def test_the_trainer_over_processes_is_fed_and_equals_the_simulation(runs) -> None:
    """``dqsgd train --transport torch`` on topology sharded runs the same exchange: its ranks fold the
    workers' norms the exchange gathers, and take the simulation's widths and policy state bit for bit."""
    world, values = runs
    sim, ledger = er.run_trainer("dqsgd-link", "sharded", None, world)
    for v in values:
        assert v["trainer"]["bits"] == [r.bits for r in ledger.records]
        assert v["trainer"]["policy"] == repr(sim.state.policy)
    assert sim.state.policy.workers == world and sim.state.policy.sigma2 > 0


@pytest.mark.timeout(600)
def test_dqsgd_link_at_link_mbit_0_runs_on_the_link_it_measured(runs) -> None:
    """HookState(method_config("dqsgd-link", link_mbit=0.0)): the link, the codec and the first bucket's
    compressed and plain steps measured once and agreed (the same Mbit/s, latency, codec slowdown k and step
    costs on every rank), the bucket's policy priced at exactly
    that rate and at k times AUTO's codec model, AUTO run at k times the rate; every rank then takes the
    same widths. The trainer over processes runs the same measured figures on every rank, its entry (the
    run's record) keeping link_mbit 0."""
    world, values = runs
    if "measured" not in values[0]:
        pytest.skip("the measured link runs at W = 2")
    per = [v["measured"] for v in values]
    config = per[0]["config"]
    assert (config.name, config.policy, config.coding, config.link_mbit) == ("dqsgd-link", "link", "auto", 0.0)
    mbit, latency, slowdown, plain, squeezed = per[0]["link"]
    assert mbit > 0 and latency >= 0 and slowdown > 0 and all(r["link"] == per[0]["link"] for r in per)
    # the first bucket's plain step and its compressed step in each priced coding timed and agreed: the
    # policy priced on the same calibration on every rank
    assert plain > 0 and [c for c, _ in squeezed] == [c for c, _ in DEFAULT_CODEC_NS] and all(v > 0 for _, v in squeezed)
    steps, plain_ns = per[0]["priced_steps"]
    assert all(r["priced_steps"] == per[0]["priced_steps"] for r in per)
    assert plain_ns >= 0 and [c for c, _ in steps] == [c for c, _ in squeezed] and all(v >= 0 for _, v in steps)
    assert all(r["priced_mbit"] == mbit for r in per)
    assert all(r["priced_codec"] == tuple((c, v * slowdown) for c, v in DEFAULT_CODEC_NS) for r in per)
    assert all(r["config_mbit"] == mbit * slowdown for r in per)  # AUTO's rate: the same order of codings
    assert all(r["bits"] == per[0]["bits"] for r in per) and per[0]["bits"][0] == {0: 4}
    trainer = [v["measured-trainer"] for v in values]
    assert all(t == trainer[0] for t in trainer) and trainer[0]["entry_mbit"] == 0.0 and trainer[0]["mbit"] > 0


@pytest.mark.timeout(600)
def test_the_default_dqsgd_is_the_stated_budget_with_its_bytes(runs) -> None:
    """HookState("dqsgd") is the budgeted DQSGD (target 4.5 bits, the both-leg split downlink), nothing
    measured: step by step the same widths, bytes and updates as the preset's fields by hand, bit for bit."""
    world, values = runs
    if "budget" not in values[0]:
        pytest.skip("the default runs at W = 2")
    for v in values:
        budget, before = v["budget"], v["before"]
        assert budget["config"].policy == "dqsgd-budget" and budget["config"].target_bits == 4.5
        assert budget["link"] is None
        assert budget["bits"] == before["bits"] and budget["sent"] == before["sent"]
        assert all(torch.equal(a[3], b[3]) for a, b in zip(budget["buckets"], before["buckets"], strict=True))
