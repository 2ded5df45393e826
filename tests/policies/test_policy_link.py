"""The link policy (policies/link.py, docs/algorithms.md §11.5c) as mathematics: its width is the
brute-force argmin of the objective written out by hand; a faster link sends wider, a slower one
narrower, a slower CPU codes less; and it runs as a method in the simulation."""

import math

import pytest
import torch
from synthetic_runs import entry, train_config

from dqsgd.data import load_dataset

from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.policies import GradStats, state_from_dict, state_to_dict
from dqsgd.policies.coded import level_entropies
from dqsgd.policies.link import LinkPolicy, LinkState, rounding_variances
from dqsgd.policies.linktime import UNCOMPRESSED
from dqsgd.policies.variance import pooled_variance, worker_norms
from dqsgd.train.trainer import Trainer

D, W = 1 << 16, 4
G = torch.randn(D, generator=torch.Generator().manual_seed(0))
NORM = float(G.abs().max())


def policy(mbit=100.0, rans_ns=11.0, **kw):
    kw = {"compute_s": 0.01, "latency_s": 1e-4, "down_widths": (UNCOMPRESSED, 4, 8), **kw}
    kw = {"codec_ns": (("fixed", 2.5), ("rans", rans_ns)), **kw}
    return LinkPolicy(D, mbit, 400.0, 4, min_bits=2, max_bits=12, **kw)


def stepped(p, sigma2, norm=NORM, workers=W):
    """The state after one step whose workers' norms give σ̂² = ``sigma2`` exactly (Σ‖g_i‖² − W‖ḡ‖²
    = W(W−1)σ²)."""
    g = G * (norm / NORM)
    m = float(g.double().dot(g.double()))
    state = p.observe_workers(p.init(), workers * (workers - 1) * sigma2 + workers * m, m, workers)
    return p.update(state, GradStats(0, norm, 0.0, 0, g))


def variance_by_hand(g, norm, b):
    """E‖Q_B(g) − g‖² of stochastic rounding at step Δ = norm/s_B, coordinate by coordinate: |g| lies
    between the levels kΔ and (k+1)Δ and goes up with probability f = |g|/Δ − k: variance Δ²·f·(1 − f)."""
    step = norm / (2 ** (b - 1) - 1)
    u = g.double().abs() / step
    f = u - u.floor()
    return float((step * step * f * (1 - f)).sum())


def j_by_hand(p, up, down, coding, norm, sigma2):
    """J = ρ·T written out from the docs, independently of linktime.py: ρ from the rounding variance at
    G's own magnitudes, both legs."""
    g = G * (norm / NORM)
    entropy = level_entropies(g, norm, range(p.min_bits, p.max_bits + 1), p.sample)

    def q(b):
        return 0.0 if b == UNCOMPRESSED else variance_by_hand(g, norm, b)

    def t(b):
        if b == UNCOMPRESSED:
            return p.latency_s + 32 * D / (p.mbit * 1e6)
        ns = dict(p.codec_ns)[coding]
        beta = b if coding == "fixed" else min(b, entropy[b - p.min_bits])
        return D * ns * 1e-9 + p.latency_s + (round(p.header_bits) + D * beta) / (p.mbit * 1e6)
    return (1 + (q(up) / W + q(down)) / sigma2) * (p.compute_s + t(up) + t(down))


@pytest.mark.parametrize("mbit", [1.0, 30.0, 300.0, 3000.0])
@pytest.mark.parametrize("rans_ns", [4.0, 11.0, 80.0])
@pytest.mark.parametrize("sigma2", [1.0, 1e3, 1e5])
@pytest.mark.parametrize("downs", [(UNCOMPRESSED, 4, 8), tuple(range(4, 13))])  # the hook's "auto": 4..max_bits
def test_the_width_is_the_brute_force_argmin(mbit, rans_ns, sigma2, downs):
    p = policy(mbit, rans_ns, down_widths=downs)
    s = stepped(p, sigma2)
    every = [(u, d, c) for c in ("fixed", "rans") for u in range(2, 13) for d in downs]
    best = min(j_by_hand(p, *x, NORM, sigma2) for x in every)
    assert j_by_hand(p, s.bits, s.down_bits, s.coding, NORM, sigma2) == pytest.approx(best, rel=1e-9)
    assert s.objective == pytest.approx(best, rel=1e-9)
    assert s.sigma2 == pytest.approx(sigma2, rel=1e-9) and s.workers == W and s.pending == ()


def test_a_faster_link_sends_wider_a_slower_one_narrower():
    """Both legs: the uplink width, and the downlink's among (4, 8, the dtype), never narrower on a faster link."""
    links = (0.3, 3.0, 30.0, 300.0, 3000.0, 30000.0)
    up = [stepped(policy(mbit=m, down_widths=(8,)), 1e4).bits for m in links]
    assert up == sorted(up) and up[0] < up[-1], up
    down = [stepped(policy(mbit=m), 1e4).down_bits for m in links]
    down = [32 if b == UNCOMPRESSED else b for b in down]  # the dtype: the widest
    assert down == sorted(down) and down[0] < down[-1], down


def test_a_slower_cpu_codes_less():
    codings = [stepped(policy(mbit=30.0, rans_ns=ns), 1e4).coding for ns in (1.0, 10.0, 100.0, 1000.0)]
    assert codings[0] == "rans" and codings[-1] == "fixed"
    assert codings == sorted(codings, key=lambda c: c == "fixed")  # once fixed, fixed from then on


def test_more_noise_hides_more_quantization_noise():
    seq = [stepped(policy(mbit=30.0), s).bits for s in (1e2, 1e3, 1e4, 1e5, 1e6)]
    assert seq == sorted(seq, reverse=True) and seq[0] > seq[-1], seq


def test_no_variance_yet_keeps_the_start_width_and_none_at_all_sends_the_widest():
    p = policy()
    s = p.update(p.init(), GradStats(0, NORM, 0.0, 0, G))  # no workers' norms handed over
    assert (s.bits, s.down_bits) == (4, UNCOMPRESSED) and math.isnan(s.sigma2)
    s = p.update(p.observe_workers(p.init(), 4.0, 1.0, 4), GradStats(0, NORM, 0.0, 0, G))  # 4 equal workers
    assert s.sigma2 == 0 and (s.bits, s.down_bits) == (12, UNCOMPRESSED)


def test_the_state_is_a_checkpoint(tmp_path):
    s = stepped(policy(), 1.0)
    torch.save(state_to_dict(s), tmp_path / "s.pt")
    assert state_from_dict(LinkState, torch.load(tmp_path / "s.pt", weights_only=True)) == s


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="down_widths"):
        policy(down_widths=(1,))
    with pytest.raises(ValueError, match="throughput"):
        policy(mbit=0.0)
    with pytest.raises(ValueError, match="no link to measure: state link_mbit"):  # 0: measured, where a link is
        Method(method_config("dqsgd-link", link_mbit=0.0), D, 10)
    with pytest.raises(ValueError, match="coding 'auto'"):
        method_config("dqsgd-link", coding="fixed")


def test_the_method_builds_its_policy_from_the_config():
    m = Method(method_config("dqsgd-link", link_mbit=10.0, compute_ms=20.0, link_latency_ms=0.5), D, 10)
    p = m.policy
    assert isinstance(p, LinkPolicy) and p.needs_worker_norms
    assert (p.mbit, p.compute_s, p.latency_s, p.start_bits, p.max_bits) == (10.0, 0.02, 0.0005, 4, 8)
    assert p.header_bits == m.message_bits(2) - 2 * D


def widths_trained(mbit: float, steps: int = 8) -> tuple[list[int], Trainer]:
    tr = Trainer(train_config(steps=steps, eval_every=1000),
                 entry("dqsgd-link", link_mbit=mbit, max_bits=12, compute_ms=50.0), load_dataset("synthetic"), 0)
    for _ in range(steps):
        tr.step()
    return [r.bits for r in tr.ledger.records], tr


def test_in_the_simulation_the_trainer_hands_over_the_norms_and_the_link_sets_the_width():
    """Through the in-process trainer (W = 4, ps: an fp32 downlink): step 0 at the start width, then the
    policy's widths; a slow link (the wire dominates the step) narrower than a fast one (50 ms of
    compute dominates: the widest width costs next to nothing more)."""
    slow, tr = widths_trained(0.05)
    fast, _ = widths_trained(5000.0)
    assert slow[0] == fast[0] == 4
    assert max(slow[1:]) < min(fast[1:]), (slow, fast)
    state = tr.state.policy
    assert isinstance(state, LinkState) and state.workers == 4 and state.sigma2 > 0 and state.pending == ()


def test_the_trainer_hands_over_exactly_the_workers_norms():
    """The σ̂² the policy holds after one step is pooled_variance of that step's four gradients."""
    tr = Trainer(train_config(steps=1, eval_every=1000), entry("dqsgd-link"), load_dataset("synthetic"), 0)
    grads = {w: tr.worker_gradient(w, 0)[0] for w in range(4)}  # what step 0 computes (a pure function of the step)
    tr.step()
    assert tr.state.policy.sigma2 == pooled_variance(*worker_norms(grads.values()))


def test_paths_that_do_not_feed_the_link_policy_refuse_it() -> None:
    """FSDP and LocalSGDOptimizer hold one worker's gradient and nothing gathers the workers' norms for
    them: the link policy, never fed, would keep its start width under a name that says it adapts, so
    each refuses it. The DDP hook's exchange gathers them (tests/distributed/test_ddp_link.py)."""
    import torch

    from dqsgd.ddp import HookState
    from dqsgd.fsdp import FSDPState
    from dqsgd.local import LocalSGDOptimizer

    for topology in ("sharded", "allgather"):
        assert HookState("dqsgd-link", topology=topology).config.policy == "link"
    model = torch.nn.Linear(3, 2)
    makers = {"FSDP's reduce-scatter": lambda: FSDPState("dqsgd-link"),
              "LocalSGDOptimizer": lambda: LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, 4,
                                                             "dqsgd-link")}
    for who, make in makers.items():
        with pytest.raises(ValueError, match=f"policy 'link' .*; {who} does not feed it"):
            make()


def test_the_rounding_variance_is_the_expected_squared_error_coordinate_by_coordinate():
    """rounding_variances is Σ Δ²·f(1 − f) over the sample, scaled to d: on the lattice 0, half-way between
    levels the most (Δ²/4 a coordinate: never above d·norm²/(4·s²)), and on G the by-hand sum."""
    widths = range(2, 9)
    assert rounding_variances(G, NORM, widths, sample=D) == pytest.approx(
        [variance_by_hand(G, NORM, b) for b in widths], rel=1e-12)
    stride = 4  # a sample of D/4 coordinates: the strided ones' sum, times 4
    assert rounding_variances(G, NORM, widths, sample=D // stride) == pytest.approx(
        [stride * variance_by_hand(G[::stride], NORM, b) for b in widths], rel=1e-12)
    s = 2 ** (3 - 1) - 1  # 3 bits: 3 levels, Δ = 1 at norm 3
    lattice = torch.tensor([0.0, 1.0, -2.0, 3.0])
    assert rounding_variances(lattice, 3.0, range(3, 4)) == [0.0]
    half = torch.tensor([0.5, -1.5, 2.5, 2.5])
    assert rounding_variances(half, 3.0, range(3, 4)) == [4 * 0.25] == [4 * 3.0 ** 2 / (4 * s * s)]
    assert rounding_variances(torch.zeros(5), 0.0, widths) == [0.0] * len(widths)


def test_gradients_far_below_their_max_norm_are_sent_narrower_than_the_bound_says():
    """One large coordinate and D − 1 small ones: the expected rounding variance (≈ Δ·‖g‖₁) is far below the
    bound d·norm²/(6 s²) that takes the fractions uniform, so on a slow link the policy's argmin (brute force,
    by hand) is a narrower width than the argmin under the bound — the choice the bound made too wide."""
    g = torch.full((D,), 1e-3)
    g[0] = 1.0
    p = policy(mbit=10.0, down_widths=(8,), codec_ns=(("fixed", 2.5),))  # widths at their FIXED size
    m, sigma2 = float(g.double().dot(g.double())), 1.0
    state = p.observe_workers(p.init(), W * (W - 1) * sigma2 + W * m, m, W)  # σ̂² = sigma2
    got = p.update(state, GradStats(0, 1.0, 0.0, 0, g))
    entropy = level_entropies(g, 1.0, range(2, 13), p.sample)

    def j(up, coding, noise):
        t = [D * dict(p.codec_ns)[coding] * 1e-9 + p.latency_s
             + (round(p.header_bits) + D * (b if coding == "fixed" else min(b, entropy[b - 2]))) / (p.mbit * 1e6)
             for b in (up, 8)]
        return (1 + (noise(up) / W + noise(8)) / sigma2) * (p.compute_s + sum(t))

    every = [(u, "fixed") for u in range(2, 13)]
    exact = min(every, key=lambda x: j(*x, lambda b: variance_by_hand(g, 1.0, b)))
    bound = min(every, key=lambda x: j(*x, lambda b: D / (6 * (2 ** (b - 1) - 1) ** 2)))
    assert (got.bits, got.coding) == exact and exact[0] < bound[0], (exact, bound)
