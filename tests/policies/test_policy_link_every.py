"""The link policy's amortised statistics (``link_every``, docs/algorithms.md §11.5c) and its downlink
choice in the hook: between re-evaluations every step sends exactly the cached choice and no statistic
of the policy is computed (calls counted, not timed); the hook's policy chooses the downlink width among
the widths that train safely, as the brute-force argmin of its time model."""

import pytest
import torch

import dqsgd.policies.link as link
import dqsgd.topology.exchange as exchange
from dqsgd.ddp import HookState
from dqsgd.method.config import method_config
from dqsgd.policies.linktime import UNCOMPRESSED, Choice, candidates, choose, objective
from dqsgd.topology.bucket import worker_generator
from dqsgd.topology.exchange import Exchange
from dqsgd.topology.group import local_groups
from dqsgd.topology.state import BucketState, Memory

D, W, STEPS = 4000, 4, 11


def counting(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, calls: dict[str, list[int]]) -> None:
    """Wrap ``owner.name`` so that each call is recorded (under ``name``)."""
    f = getattr(owner, name)
    calls[name] = []

    def g(*a, **k):
        calls[name].append(1)
        return f(*a, **k)

    monkeypatch.setattr(owner, name, g)


def run(every: int, monkeypatch: pytest.MonkeyPatch | None = None, mbit: float = 10.0, **kw):
    """STEPS exchanges of W noisy copies of one gradient through the hook's protocol of ``dqsgd-link`` (in
    one process): per step (the choice it was sent at, the policy state after it) and the calls counted."""
    state = HookState(method_config("dqsgd-link", link_mbit=mbit, link_every=every), seed=3, total_steps=100, **kw)
    proto = state.protocol(0, D, [D], W, torch.float32)
    b = BucketState(numel=D, proto=proto, policy=proto.policy.init(), generator=worker_generator(3, 0, 0),
                    sizes=(D,))
    mems = [b] + [Memory(generator=worker_generator(3, r, 0)) for r in range(1, W)]
    calls: dict[str, list[int]] = {}
    if monkeypatch is not None:
        for owner, name in ((link, "level_entropies"), (link, "rounding_variances"), (exchange, "own_figures"),
                            (BucketState, "record"), (BucketState, "hand_workers")):
            counting(monkeypatch, owner, name, calls)
    gen, groups, out = torch.Generator().manual_seed(0), local_groups(W), []
    grad = torch.linspace(-1.0, 1.0, D)
    for s in range(STEPS):
        b.prepare(torch.device("cpu"))
        sent = (b.bits, b.proto.down_width(b.policy), b.policy.coding)
        flats = {r: (grad + 0.3 * torch.randn(D, generator=gen), groups[r], mems[r]) for r in range(W)}
        groups[0].wait(Exchange(b).start(flats)[0])
        out.append((sent, b.policy))
    return out, {k: len(v) for k, v in calls.items()}


def test_between_re_evaluations_the_cached_choice_and_no_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    """link_every = 4: the figures gathered, G recorded, the workers' norms handed over and the entropies
    and rounding variances computed at steps 0, 4 and 8 only (3 times in 11 steps); every step from 1 to 4
    sends the choice taken from step 0's statistics, 5 to 8 step 4's, each exactly the state's."""
    steps, calls = run(4, monkeypatch)
    assert calls == {"level_entropies": 3, "rounding_variances": 3, "own_figures": 3 * W, "record": 3,
                     "hand_workers": 3}, calls  # own_figures: once per rank
    def choice(p):
        return p.bits, p.down_bits, p.coding

    for s in range(1, STEPS):
        first = (s - 1) // 4 * 4 + 1  # the first step sent at the choice of the last evaluated step (s − 1 or before)
        assert steps[s][0] == choice(steps[s][1]) == choice(steps[first][1]), s  # sent: the cached choice
        if s % 4:  # no figures handed over: the state is the cached one, unchanged
            assert steps[s][1] == steps[first][1], s
    assert steps[1][1].workers == W and steps[1][1].sigma2 > 0 and steps[1][1].pending == ()


def test_every_step_observed_computes_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """link_every = 1: the statistics of every step (the old behaviour, still available)."""
    _, calls = run(1, monkeypatch)
    assert calls == {"level_entropies": STEPS - 1, "rounding_variances": STEPS - 1, "own_figures": STEPS * W,
                     "record": STEPS, "hand_workers": STEPS}, calls


def test_the_choice_at_an_evaluation_does_not_depend_on_the_steps_between() -> None:
    """σ̂² is folded from the evaluated steps alone: the policy after step 4 with link_every = 4 is the one
    after one update on step 0's and step 4's figures, whatever was sent between (the same bits here)."""
    four, _ = run(4)
    again, _ = run(4)
    assert [repr(p) for _, p in four] == [repr(p) for _, p in again]  # deterministic: same seed, same states


def test_the_hook_policy_chooses_its_downlink_among_the_safe_widths() -> None:
    """HookState("dqsgd-link") on sharded: downlink_bits "auto", the policy choosing among 4..max_bits (2..
    with downlink_feedback), a fixed downlink_bits still pins it; on a slow link the choice is the
    brute-force argmin of J over (up, down, coding) with down in 4..8, and the down width it sends is
    the one it chose."""
    assert HookState("dqsgd-link").downlink_bits == "auto"
    p = HookState("dqsgd-link").protocol(0, D, [D], W, torch.float32).policy
    assert p.down_widths == (4, 5, 6, 7, 8) and p.uncompressed
    fed = HookState("dqsgd-link", downlink_feedback=True).protocol(0, D, [D], W, torch.float32).policy
    assert fed.down_widths == tuple(range(2, 9))
    pinned = HookState("dqsgd-link", downlink_bits=6).protocol(0, D, [D], W, torch.float32).policy
    assert pinned.down_widths == (6,)
    steps, _ = run(1, mbit=1.0)
    assert all(4 <= p.down_bits <= 8 for _, p in steps)
    assert all(sent[1] == p.down_bits for sent, p in steps)  # sent as chosen
    assert steps[-1][1].down_bits < 8  # not pinned at the fixed default
    model = p.model(())
    cands = [Choice(UNCOMPRESSED, UNCOMPRESSED, "")] + [Choice(u, d, c) for c in ("fixed", "rans")
                                                          for u in range(2, 9) for d in range(4, 9)]
    assert set(candidates(model, 2, 8, True, p.down_widths)) == set(cands)
    j = {c: objective(model, c, d=D, norm=1.0, sigma2=10.0, workers=W) for c in cands}
    best = min(j.values())
    c = choose(model, d=D, norm=1.0, sigma2=10.0, workers=W, min_bits=2, max_bits=8, downs=p.down_widths)
    assert j[c] == best
