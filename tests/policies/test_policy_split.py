"""One budget for both legs of the sharded step (``downlink_bits = "auto"``, :mod:`dqsgd.policies.split`):
the pair (u, v) of least bound among the affordable pairs, the budget never overspent by what the ledger
measured, the continuous optimum v = u + ½·log2 W, fixed methods unchanged, and the configuration checks."""

import itertools
import math

import numpy as np
import pytest
import torch
from synthetic_runs import entry, train_config

from dqsgd import theory
from dqsgd.core.config_file import ConfigError
from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.policies.base import GradStats
from dqsgd.policies.split import LegCosts, SplitBudget, choose_pair
from dqsgd.topology.bucket import BucketProtocol
from dqsgd.topology.downspec import downlink_of
from dqsgd.train.config import TrainConfig, build_experiment
from dqsgd.train.trainer import Trainer

DATA = load_dataset("synthetic")


def _protocol(name: str = "dqsgd", workers: int = 4, numel: int = 20_000, steps: int = 50, feedback: bool = False,
              **kw: object) -> BucketProtocol:
    m = Method(method_config(name, **kw), numel, steps)
    return BucketProtocol(m.config, numel, [numel], topology="sharded", workers=workers, seed=0, total_steps=steps,
                          method=m, spec=downlink_of({"downlink_bits": "auto", "downlink_feedback": feedback}, m.config,
                                                     "sharded"))


def test_the_protocol_runs_its_split_and_leaves_the_methods_policy_alone() -> None:
    """Under "auto" the bucket's policy is the split of the both-leg budget over the method's policy; the
    method keeps its own (two protocols over one method do not stack their splits)."""
    m = Method(method_config("dqsgd"), 20_000, 50)
    own = m.policy
    P = BucketProtocol(m.config, 20_000, [20_000], topology="sharded", workers=4, seed=0, total_steps=50,
                       downlink_bits="auto", method=m)
    Q = BucketProtocol(m.config, 20_000, [20_000], topology="sharded", workers=4, seed=0, total_steps=50,
                       downlink_bits="auto", method=m)
    assert m.policy is own and not isinstance(own, SplitBudget)
    assert isinstance(P.policy, SplitBudget) and P.policy.budget_bits == Q.policy.budget_bits
    assert m.init_state(4, P.policy).policy == P.policy.init() != m.init_state(4).policy


@pytest.mark.parametrize("seed", range(6))
def test_choose_pair_is_the_brute_force_minimum(seed: int) -> None:
    """The least Q among the pairs whose cost fits, ties to the cheaper then the smaller row; the
    cheapest pair when none fits."""
    rng = np.random.default_rng(seed)
    cost = rng.integers(0, 12, size=(5, 7)).astype(np.float64)  # many equal costs
    q = rng.integers(0, 6, size=(5, 7)).astype(np.float64)      # and equal bounds: the tie rules decide
    for allowance in (-1.0, 0.0, 3.5, 6.0, 11.0, 100.0):
        fits = [(q[i, j], cost[i, j], i, j) for i, j in itertools.product(range(5), range(7)) if cost[i, j] <= allowance]
        want = min(fits)[2:] if fits else min((cost[i, j], i, j) for i, j in itertools.product(range(5), range(7)))[1:]
        assert tuple(int(x) for x in choose_pair(cost, q, allowance)) == want


def test_the_bound_of_a_pair_is_the_two_stage_term() -> None:
    legs = LegCosts((2, 3, 8), (4, 8), (0, 0), 4)
    for (i, u), (j, v) in itertools.product(enumerate(legs.up), enumerate(legs.down)):
        s_u, s_v = theory.real_levels(u), theory.real_levels(v)
        assert legs.q[i, j] == pytest.approx(1 / (4 * s_u**2) + 1 / s_v**2, rel=1e-12)
    beq = legs.equivalent_bits(legs.q)  # uplink-only width of the same bound: below u, the downlink costs some
    assert np.all(beq < np.array(legs.up)[:, None])


@pytest.mark.parametrize("workers", [4, 16])
def test_continuous_optimum_gives_the_downlink_half_log2_w_more_bits(workers: int) -> None:
    """Equal cost per bit on both legs, wide widths (where s ≈ 2^(b−1)): the best pair of u + v bits has
    v − u = ½·log2 W where the parity of u + v allows it (W = 4: one bit more; W = 16: two), else one
    of the two neighbours."""
    up, down = tuple(range(2, 17)), tuple(range(2, 17))
    legs = LegCosts(up, down, tuple(1000 * v for v in down), workers)
    cost = np.add.outer(1000 * np.array(up, dtype=np.float64), 1000 * np.array(down, dtype=np.float64))
    for total in range(16, 29):  # u + v bits per coordinate, both legs
        i, j = choose_pair(cost, legs.q, 1000 * total)
        half = round(0.5 * math.log2(workers))
        assert up[i] + down[j] == total
        assert down[j] - up[i] == half if (total - half) % 2 == 0 else abs(down[j] - up[i] - half) == 1, total


def _stats(step: int, norm: float, spent: int) -> GradStats:
    return GradStats(step, norm, norm / 10, spent, None)


@pytest.mark.parametrize("feedback", [False, True])
def test_every_pair_is_affordable_and_least_bound_for_its_cost(feedback: bool) -> None:
    """Over a run with the exact costs charged: never overspent, every chosen pair is the least Q among
    the pairs at most as costly and fits what the remaining steps leave; without feedback v >= 4."""
    P = _protocol(steps=60, feedback=feedback, target_bits=2.5)
    pol: SplitBudget = P.policy
    assert min(pol.legs.down) == (2 if feedback else 4)
    up = pol.upper_up()
    cost, q = pol.costs(up), pol.legs.q
    state, spent, norms = pol.init(), 0, 3.0 * np.exp(-np.arange(60) / 25) * (1 + 0.3 * np.sin(np.arange(60)))
    for n in range(60):
        i, j = pol.legs.up.index(state.bits), pol.legs.down.index(state.down_bits)
        left = pol.budget_bits - spent - (59 - n) * cost.min()
        assert cost[i, j] <= left, n  # the steps left can still be paid at the cheapest pair
        assert q[i, j] == q[cost <= cost[i, j]].min(), n
        spent += int(cost[i, j])
        state = pol.update(state, _stats(n, float(norms[n]), int(cost[i, j])))
        assert state.spent == spent
    assert spent <= pol.budget_bits and spent >= 0.97 * pol.budget_bits, spent / pol.budget_bits


def _ledger_bits(tr: Trainer) -> int:
    return sum(8 * max(r.up_bytes) + 8 * r.down_bytes for r in tr.ledger.records)


@pytest.mark.parametrize("name,target", [("dqsgd", 4.5), ("dqsgd", 2.0), ("dqsgd-coded", 1.0)])
def test_both_legs_never_overspent_in_training(name: str, target: float) -> None:
    """Real training through the sharded simulation: the ledger's measured bytes of both legs, with the side
    traffic the budget pays (a coded method's size tables and coded downlink lengths: ``side_bits`` a step),
    stay within C at every step and end within 2% of it; the widths of both legs move."""
    steps = 30
    tr = Trainer(train_config(steps=steps, topology="sharded", eval_every=1000, coded_every=0, model="logreg",
                              threads=1),
                 entry(name, target_bits=target), DATA, 0)
    assert tr.downlink_bits == "auto" and tr.ledger.both_legs
    budget, pairs, side = tr.ledger.budget_bits, [], tr.step_runner.protocol.side_bits
    assert side == (960 if name == "dqsgd-coded" else 0)  # W = 4: 4 sizes and a length, int64, to 3 peers
    for _ in range(steps):
        pairs.append((tr.state.bits, tr.step_runner.protocol.down_width(tr.state.policy)))
        tr.step()
        assert _ledger_bits(tr) == tr.ledger.spent_bits() <= budget - tr.next_step * side, tr.next_step
    assert tr.ledger.spent_bits() + steps * side >= 0.98 * budget, (tr.ledger.spent_bits() / budget, pairs)
    assert all(v >= 4 for _, v in pairs) and len(set(pairs)) > 1, pairs


def test_auto_budget_is_the_uplink_budget_plus_an_8_bit_downlink() -> None:
    P = _protocol(steps=50, target_bits=3.0)
    down8 = 8 * sum(P.down_sizes(8))
    assert P.policy.budget_bits == Method(method_config("dqsgd", target_bits=3.0), 20_000, 50).budget_bits() \
        + 50 * down8


def test_fixed_methods_are_unchanged_by_the_default() -> None:
    """qsgd keeps its 8-bit downlink when downlink_bits is left unset: bitwise the same run as 8 given."""
    runs = []
    for dl in (0, 8):
        tr = Trainer(train_config(steps=4, topology="sharded", eval_every=1000, downlink_bits=dl, threads=1),
                     entry("qsgd-4bit"), DATA, 0)
        for _ in range(4):
            tr.step()
        runs.append((torch.cat([p.detach().reshape(-1) for p in tr.params]),
                     [(r.up_bytes, r.down_bytes) for r in tr.ledger.records], tr.downlink_bits))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1:] == runs[1][1:] and runs[0][2] == 8


@pytest.mark.parametrize("name,topology,match", [
    ("qsgd-4bit", "sharded", "needs a budgeted policy"), ("dqsgd-nonconvex", "sharded", "needs a budgeted policy"),
    ("dqsgd", "ps", "topology 'ps'"), ("dqsgd", "allgather", "topology 'allgather'"),
    ("signsgd", "sharded", "majority vote"),
])
def test_auto_refused_where_it_means_nothing(name: str, topology: str, match: str) -> None:
    with pytest.raises(ValueError, match=f"train.downlink_bits: .*{match}"):
        Trainer(train_config(steps=2, topology=topology, downlink_bits="auto", threads=1), entry(name), DATA, 0)


def test_config_accepts_auto_and_refuses_other_words() -> None:
    assert TrainConfig(downlink_bits="auto").downlink_bits == "auto"
    raw = {"train": {"downlink_bits": "auto"}, "methods": {"q": {"method": "qsgd-4bit", "downlink_bits": 4}}}
    exp = build_experiment(raw)
    assert exp.train.downlink_bits == "auto" and dict(exp.methods[0].train)["downlink_bits"] == 4
    for bad in ("fast", True, 1, 17, 33):
        with pytest.raises(ConfigError, match="downlink_bits"):
            build_experiment({"train": {"downlink_bits": bad}})


def test_hook_state_resolves_and_refuses_auto() -> None:
    from dqsgd.ddp import HookState

    assert HookState("dqsgd").downlink_bits == "auto"
    assert HookState("dqsgd", topology="allgather").downlink_bits == 8
    assert HookState("qsgd-4bit").downlink_bits == 8
    assert HookState("dqsgd", downlink_bits=6).downlink_bits == 6
    with pytest.raises(ValueError, match="needs a budgeted policy"):
        HookState("qsgd-4bit", downlink_bits="auto")
    with pytest.raises(ValueError, match="topology 'allgather'"):
        HookState("dqsgd", topology="allgather", downlink_bits="auto")
