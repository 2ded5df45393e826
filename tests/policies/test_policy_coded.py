"""The byte-budgeted DQSGD policy (``dqsgd-coded``): its entropy estimate, and its budget of coded bytes
spent through real training (never overspent, within 1% of C for N >= 100)."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from synthetic_runs import entry as method_entry, train_config
from test_policies import (assert_runs_equal, cost_fn, random_norms, reference_scales, reference_solve_log_k,
                           reference_widths)

from dqsgd.data import load_dataset
from dqsgd.kernels import HashRNG
from dqsgd.method.config import method_config
from dqsgd.policies import CodedBudgetedDQSGD, GradStats, level_entropies
from dqsgd.quantizers import dequantize, quantize_uniform
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.runner import run_one
from dqsgd.train.trainer import Trainer

DATA = load_dataset("synthetic")


def cfg(**kw) -> TrainConfig:
    return train_config(**{**dict(steps=120, eval_every=1000), **kw})


def entry(**kw) -> MethodEntry:
    return method_entry("dqsgd-coded", **kw)


def empirical_entropy(codes: torch.Tensor) -> float:
    counts = torch.bincount(codes.to(torch.int64) - int(codes.min())).to(torch.float64)
    p = counts[counts > 0] / codes.numel()
    return float(-(p * torch.log2(p)).sum())


@pytest.mark.parametrize("bits", [2, 4, 6])
def test_expected_entropy_matches_the_entropy_of_real_levels(bits: int) -> None:
    """H_B from the rounding probabilities equals the empirical entropy of sampled levels: the plug-in
    estimate of n = 2^20 levels is within a few 1e-3 bits (bias ~ (K−1)/(2n ln 2) for K symbols)."""
    g = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)) ** 3  # heavy tails, like gradients
    norm = float(g.abs().max())
    predicted = level_entropies(g, norm, range(bits, bits + 1), sample=1 << 20)[0]
    q = quantize_uniform(g, bits, torch.Generator().manual_seed(4))
    measured = empirical_entropy(q.codes.reshape(-1))
    assert measured == pytest.approx(predicted, abs=5e-3), (measured, predicted)


def test_expected_entropy_edge_cases() -> None:
    assert level_entropies(torch.zeros(10), 0.0, range(2, 5)) == [0.0, 0.0, 0.0]
    g = torch.tensor([1.0, -1.0])  # both coordinates at the norm: two symbols, one bit, every width
    assert level_entropies(g, 1.0, range(2, 9)) == pytest.approx([1.0] * 7)
    h = level_entropies(torch.randn(5000, generator=torch.Generator().manual_seed(0)), 3.0, range(2, 17))
    assert all(b >= a - 1e-12 for a, b in zip(h, h[1:]))  # finer levels never carry less information


def test_costs_never_exceed_fixed_and_do_not_decrease() -> None:
    d = 10_000
    fixed = lambda b: 8 * (40 + -(-d * b // 8))  # noqa: E731
    pol = CodedBudgetedDQSGD(200 * fixed(2), 200, d, fixed)
    ent = tuple(level_entropies(torch.randn(d, generator=torch.Generator().manual_seed(1)), 4.0, pol.widths))
    for ratio in (0.5, 1.0, 3.0, 100.0):
        c = pol.costs(ent, ratio)
        assert np.all(np.diff(c) >= 0) and np.all(c <= [fixed(b) for b in pol.widths])
    assert list(pol.costs((), float("nan"))) == [fixed(b) for b in pol.widths]  # no estimate yet: the fixed size


def test_widths_above_the_measured_one_are_costed_from_the_measurement() -> None:
    """G after a 2-bit step is the mean of W ternary messages: few distinct values, so H_B(G) barely grows
    with B. A worker's own vector gains about a bit per coordinate per bit of width, so the next width
    must be costed from the measured size plus that, or one step can spend many steps' share."""
    d, workers, steps = 20_000, 4, 20
    fixed = lambda b: 8 * (40 + -(-d * b // 8))  # noqa: E731
    pol = CodedBudgetedDQSGD(steps * fixed(2) // 2, steps, d, fixed)
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(d, generator=gen) ** 3
    coarse = torch.stack([dequantize(quantize_uniform(g + 0.3 * torch.randn(d, generator=gen), 2, gen))
                          for _ in range(workers)]).mean(0)
    state = pol.init()
    measured = 2 * d // 5  # coded bits one worker sent at state.bits (0.4 bits per coordinate)
    new = pol.update(state, GradStats(0, float(coarse.abs().max()), 0.0, measured, coarse))
    raw = pol.costs(new.entropy, new.ratio)
    floor = pol.above_measured(raw, state.bits, measured, 1.0)
    above = [b - pol.min_bits for b in pol.widths if b > state.bits]
    assert np.all(floor[above] >= np.minimum([measured + d * (b - state.bits) for b in pol.widths if b > state.bits],
                                             [fixed(b) for b in pol.widths if b > state.bits]))
    assert np.all(np.diff(floor) >= 0) and np.all(floor <= [fixed(b) for b in pol.widths])
    assert raw[-1] < 0.5 * floor[-1]  # what the old cost said at 16 bits: well under half of it
    share = (pol.budget_bits - measured) / (steps - 1)
    assert pol.above_measured(raw, state.bits, measured, 1.0)[new.bits - pol.min_bits] <= 2 * share  # no jump


def test_refused_configurations() -> None:
    with pytest.raises(ValueError, match="coding 'auto'"):
        method_config("dqsgd-coded", coding="fixed")
    with pytest.raises(ValueError, match="exactly one of budget_bits"):
        method_config("dqsgd-coded", budget_bits=10_000)  # and the preset's target_bits
    d = 1000
    fixed = lambda b: 8 * (40 + -(-d * b // 8))  # noqa: E731
    with pytest.raises(ValueError, match="infeasible coded budget"):
        CodedBudgetedDQSGD(100 * 8 * 40, 100, d, fixed)  # the headers alone use it all
    with pytest.raises(ValueError, match="needs the aggregated gradient"):
        pol = CodedBudgetedDQSGD(100 * fixed(4), 100, d, fixed)
        pol.update(pol.init(), GradStats(0, 1.0, 1.0, fixed(2)))


@pytest.mark.parametrize("steps,target,topology", [
    (100, 0.5, "ps"), (120, 1.0, "ps"), (150, 2.0, "ps"), (120, 0.8, "sharded"), (120, 1.5, "allgather"),
])
def test_coded_budget_never_overspent_and_lands_within_1pct(tmp_path: Path, steps: int, target: float,
                                                            topology: str) -> None:
    """Real training, real auto-coded payloads: the ledger's coded bits (max over workers, every step) stay
    within C at every step and end within 1% of C."""
    c = cfg(steps=steps, topology=topology)
    tr = Trainer(c, entry(target_bits=target), DATA, 0)
    budget = tr.ledger.budget_bits
    assert budget == tr.policy.budget_bits and budget > 0
    for _ in range(steps):
        tr.step()
        assert tr.ledger.spent_bits() <= budget, f"overspent at step {tr.next_step - 1}"
    spent = tr.ledger.spent_bits()
    assert spent >= 0.99 * budget, (spent / budget, [r.bits for r in tr.ledger.records])
    widths = {r.bits for r in tr.ledger.records}
    assert len(widths) > 1  # it does adapt: not one fixed width


def test_coded_budget_spends_far_fewer_bits_than_its_widths(tmp_path: Path) -> None:
    """At 1 coded bit per coordinate the widths average well above 1 bit: the entropy coding pays for them."""
    s = run_one(cfg(steps=100), entry(target_bits=1.0), DATA, 0, tmp_path, progress=False)
    assert s["ledger_budget_left"] >= 0
    assert s["ledger_mean_bits"] > 2.5, s["ledger_mean_bits"]


def test_coded_policy_resumes_exactly(tmp_path: Path) -> None:
    from dqsgd.train.checkpoint import save_checkpoint

    c = cfg(steps=14, checkpoint_every=5)
    full = run_one(c, entry(target_bits=1.0), DATA, 1, tmp_path / "full", progress=False)
    tr = Trainer(c, entry(target_bits=1.0), DATA, 1)
    for _ in range(5):
        tr.step()
    save_checkpoint(tr, tmp_path / "part" / "checkpoint.pt")
    resumed = run_one(c, entry(target_bits=1.0), DATA, 1, tmp_path / "part", resume=True, progress=False)
    assert torch.equal(full["final_params"], resumed["final_params"])
    assert resumed["ledger_budget_left"] == full["ledger_budget_left"]
    assert math.isfinite(resumed["ledger_budget_left"])


class ReferenceCoded(CodedBudgetedDQSGD):
    """The solve before the cheaper bisection, as it was (the reference for bit-identical states)."""

    def solve_coded_k(self, step: int, norm: float, forecast: np.ndarray, cost: np.ndarray,
                      remaining: float) -> tuple[float, float]:
        scales = reference_scales(self, step)
        norms = np.concatenate([[norm], forecast]).astype(np.float64)
        grid = np.arange(self.min_bits, self.max_bits + 1, dtype=np.float64)

        def total(logk: float) -> float:
            return float(np.interp(reference_widths(self, math.exp(logk), norms, scales), grid, cost).sum())

        k = reference_solve_log_k(total, remaining)
        return k, float(reference_widths(self, k, norms[:1], scales[:1])[0])


@pytest.mark.parametrize("seed", range(10))
def test_coded_states_bit_identical_to_the_reference(seed: int) -> None:
    """Whole runs of random coded policies (convex or not, tight or generous budgets) on random gradients
    whose coded sizes swing around the prediction: the same states, bit for bit, after every update."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.choice([1, 2, int(rng.integers(3, 100)), int(rng.integers(100, 700))]))
    d = int(rng.integers(1, 3000))
    cost = cost_fn(d, int(rng.integers(1, 64)))
    lo = int(rng.integers(2, 6))
    hi = int(rng.integers(lo, 17))
    budget = n * cost(lo) * float(rng.choice([0.3, 0.6, 1.0, 2.0, 4.0]))
    alpha = float(rng.choice([1.0, rng.uniform(0.5, 1.0)]))
    kw = dict(budget_bits=int(budget), total_steps=n, numel=d, message_bits=cost, convex=bool(rng.random() < 0.5),
              alpha=alpha, min_bits=lo, max_bits=hi, smoothing=float(rng.uniform(0.05, 1.0)), sample=256)
    policy, ref = CodedBudgetedDQSGD(**kw), ReferenceCoded(**kw)
    norms = random_norms(rng, n)
    shape = torch.from_numpy(rng.standard_normal(d)) ** 3
    grads = lambda i: shape / shape.abs().max() * norms[i]  # noqa: E731
    spend = lambda st_, i: int(cost(st_.bits) * rng.uniform(0.05, 1.0))  # noqa: E731
    assert_runs_equal(policy, ref, norms, spend, grads)
