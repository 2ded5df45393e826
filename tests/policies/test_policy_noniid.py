"""The coded budget over few rounds of disagreeing workers (Local SGD on a Dirichlet split, issue 38): the
first width, the bound's term of the first aggregate, the budget through such a run, the widths G resolves,
and the norm trend of runs of at most 200 steps."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.policies import BudgetedDQSGD, CodedBudgetedDQSGD, GradStats, level_entropies
from dqsgd.policies.budgeted import _observe, forecast_norms, trend_count
from dqsgd.quantizers import dequantize, quantize_uniform
from dqsgd.quantizers.constants import levels_for_bits
from dqsgd.theory import exact_quantization_variance


def fixed_cost(d: int, header_bytes: int = 40):
    return lambda b: 8 * (header_bytes + -(-d * b // 8))


def test_first_width_is_the_start_width_where_the_budget_can_pay_it() -> None:
    """B_0 = start_bits, lowered while its fixed size and the N − 1 later headers exceed C; never below the
    share rule (the largest width whose fixed size fits C/N), which alone decides without a start width."""
    d, n = 10_000, 19
    cost = fixed_cost(d)
    header = cost(2) - 2 * d
    budget = int(n * (header + 0.8 * d))  # 0.8 coded bits per coordinate: below every fixed size
    assert CodedBudgetedDQSGD(budget, n, d, cost).init().bits == 2  # the share rule: min_bits
    assert CodedBudgetedDQSGD(budget, n, d, cost, start_bits=6).init().bits == 6
    assert CodedBudgetedDQSGD(budget, n, d, cost, start_bits=16).init().bits == 15
    assert cost(15) + (n - 1) * header <= budget < cost(16) + (n - 1) * header  # 16 bits would leave no headers
    generous = n * cost(8)
    assert CodedBudgetedDQSGD(generous, n, d, cost, start_bits=3).init().bits == 8  # the share rule's 8 bits
    with pytest.raises(ValueError, match="start_bits 1 outside"):
        CodedBudgetedDQSGD(budget, n, d, cost, start_bits=1)


@settings(max_examples=200, deadline=None)
@given(d=st.integers(1, 5000), n=st.integers(1, 300), per=st.floats(0.05, 20.0), start=st.integers(2, 16),
       header_bytes=st.integers(1, 64))
def test_first_width_properties(d: int, n: int, per: float, start: int, header_bytes: int) -> None:
    """At any budget that pays the headers: B_0 is at least the share rule's width, at most the larger of it and
    the start width, and above the share rule only where its fixed size leaves the later headers paid."""
    cost = fixed_cost(d, header_bytes)
    header = cost(2) - 2 * d
    budget = int(n * (header + per * d)) + 1
    share = CodedBudgetedDQSGD(budget, n, d, cost).init().bits
    b0 = CodedBudgetedDQSGD(budget, n, d, cost, start_bits=start).init().bits
    assert share <= b0 <= max(share, start)
    assert b0 == share or cost(b0) + (n - 1) * header <= budget


def test_the_coded_method_starts_at_its_configured_width() -> None:
    """``bits`` is the start width B_0 of a dynamic policy (docs/config.md); the coded budget honours it."""
    for bits in (2, 4, 6):
        m = Method(method_config("dqsgd-coded", target_bits=0.8, bits=bits), 61_706, 19)
        assert m.policy.init().bits == bits


def disagreeing_round(gen: torch.Generator, scale: float, workers: int, d: int) -> list[torch.Tensor]:
    """W pseudo-gradients that share a small common part and differ by heavy-tailed parts of their own
    (Dirichlet label skew: each worker moves toward its own classes): Σ‖Δ_w − Δ̄‖²/(W‖Δ̄‖²) ≈ 3.4²·7/8 ≈ 10."""
    common = torch.randn(d, generator=gen) ** 3
    own = torch.randn(workers, d, generator=gen) ** 3
    own -= own.mean(0)  # what one worker gains the others lose: the mean is the common part alone
    return [scale * (common + 3.4 * own[w]) for w in range(workers)]


def relative_variance(vs: list[torch.Tensor], bits: int) -> float:
    """E‖Ĝ − Δ̄‖²/‖Δ̄‖² for Ĝ the mean of the workers' max-norm messages at ``bits`` (independent roundings:
    the variances add, each exact, :func:`dqsgd.theory.exact_quantization_variance`)."""
    mean = torch.stack(vs).mean(0).double()
    var = sum(exact_quantization_variance(v, levels_for_bits(bits), math.inf) for v in vs) / len(vs) ** 2
    return var / float(mean.norm() ** 2)


def test_the_first_aggregate_of_disagreeing_workers_is_signal_at_the_start_width() -> None:
    """The bound's term of a round is the quantization variance of the mean, Σ_w d‖Δ_w‖∞²/(4W²s²): the workers'
    norms, not the mean's. Workers that disagree as a Dirichlet(0.1) split's do in the first Local SGD round
    (Σ‖Δ_w − Δ̄‖²/(W‖Δ̄‖²) ≈ 10 here, 10.3 measured) make the min_bits aggregate mostly noise (41× ‖Δ̄‖²
    measured in round 0): the share rule's first width of a 0.8-bit coded budget. The start width 6 of
    ``dqsgd-coded`` brings it under the signal."""
    d, workers = 8_000, 8
    vs = disagreeing_round(torch.Generator().manual_seed(3), 1.0, workers, d)
    mean = torch.stack(vs).mean(0)
    disagreement = sum(float((v - mean).norm() ** 2) for v in vs) / workers / float(mean.norm() ** 2)
    assert 5 < disagreement < 20
    m = Method(method_config("dqsgd-coded", target_bits=0.8), d, 19)
    share = CodedBudgetedDQSGD(m.budget_bits(), 19, d, m.message_bits).init().bits
    assert share == 2 and relative_variance(vs, share) > 5  # noise several times the signal
    assert m.policy.init().bits == 6 and relative_variance(vs, 6) < 0.1


def test_decaying_rounds_of_disagreeing_workers_never_overspend_from_the_start_width() -> None:
    """19 rounds of 8 disagreeing workers whose pseudo-gradients shrink by 0.7 a round (a decaying learning
    rate), each round's G the mean of the workers' messages at the policy's width, its cost the largest
    worker's expected coded size (exact level entropies of its own vector): the first round at the start
    width (a fifth of C here, the share rule would take a nineteenth) leaves every later round paid: the budget
    is never overspent."""
    d, workers, n, target = 4_000, 8, 19, 0.8
    cost = fixed_cost(d)
    header = cost(2) - 2 * d
    policy = CodedBudgetedDQSGD(int(n * (header + target * d)), n, d, cost, start_bits=6, sample=d)
    gen = torch.Generator().manual_seed(7)
    state, spent, widths, norms = policy.init(), 0, [], []
    for r in range(n):
        vs = disagreeing_round(gen, 0.7 ** r, workers, d)
        widths.append(state.bits)
        worst = max(level_entropies(v, float(v.abs().max()), range(state.bits, state.bits + 1), d)[0] for v in vs)
        step_bits = int(header + math.ceil(worst * d))
        spent += step_bits
        assert spent <= policy.budget_bits, f"overspent at round {r}: {spent} > {policy.budget_bits}"
        g = torch.stack([dequantize(quantize_uniform(v, state.bits, gen)) for v in vs]).mean(0)
        norms.append(float(g.abs().max()))
        state = policy.update(state, GradStats(r, norms[-1], 0.0, step_bits, g))
    assert widths[0] == 6 and spent <= policy.budget_bits


def test_resolution_is_the_widest_width_the_magnitudes_fill() -> None:
    """R = the largest B with 2^(B−1) − 1 ≤ K distinct nonzero magnitudes of G's sample: one ternary message
    (K = 1) resolves 2 bits, as the old floor assumed of every G; a dequantized 8-bit message (K = 127) 8;
    the mean of 8 ternary messages of different scales (K in the hundreds) about 2 + log2 8 bits or more."""
    d = 20_000
    cost = fixed_cost(d)
    pol = CodedBudgetedDQSGD(100 * cost(4), 100, d, cost)
    gen = torch.Generator().manual_seed(11)
    g = torch.randn(d, generator=gen) ** 3
    assert pol.resolution(dequantize(quantize_uniform(g, 2, gen))) == 2
    u = 2 * torch.rand(d, generator=gen) - 1  # every one of the 127 levels occupied
    assert pol.resolution(dequantize(quantize_uniform(u, 8, gen))) == 8
    assert pol.resolution(dequantize(quantize_uniform(g, 8, gen))) <= 8  # heavy tails leave high levels empty
    assert pol.resolution(g) == 15  # 20 000 distinct magnitudes: s_15 = 16 383 ≤ K < s_16
    mean = torch.stack([dequantize(quantize_uniform(g * (1 + w / 8), 2, gen)) for w in range(8)]).mean(0)
    k = int(torch.count_nonzero(torch.unique(mean.abs())))
    assert pol.resolution(mean) == max(b for b in range(2, 17) if levels_for_bits(b) <= k) >= 5
    assert pol.resolution(torch.zeros(d)) == 2


def test_widths_up_to_the_resolution_keep_their_entropy_cost() -> None:
    """Floored above a = max(measured, R) only: up to a the cost is the entropy estimate (never below the
    measured body), above a the cost at a plus one bit per coordinate per extra bit, capped by fixed(B)."""
    d = 20_000
    cost = fixed_cost(d)
    pol = CodedBudgetedDQSGD(100 * cost(4), 100, d, cost)
    est = np.array([pol.header_bits + d * 0.3 * (b - 1) for b in pol.widths], dtype=np.float64)  # entropy costs
    measured, spent = 2, int(pol.header_bits + 0.35 * d)
    floored = pol.above_measured(est, measured, spent, 1.0, resolved=6)
    i = lambda b: b - pol.min_bits  # noqa: E731
    assert floored[i(2)] == est[i(2)]
    for b in range(3, 7):  # resolved: the entropy estimate, raised to the measured body where it is lower
        assert floored[i(b)] == max(est[i(b)], spent)
    for b in range(7, 17):
        assert floored[i(b)] == min(est[i(6)] + d * (b - 6), cost(b))
    old = pol.above_measured(est, measured, spent, 1.0)  # no resolution: floored from the measured width
    assert old[i(4)] == spent + 2 * d > floored[i(4)]


@pytest.mark.parametrize("total_steps", [19, 100, 200])
def test_forecast_of_a_log_linear_sequence_is_the_line_for_runs_up_to_200_steps(total_steps: int) -> None:
    """τ = max(10, N/20) = 10 for N ≤ 200: the weighted least-squares line through exact log-linear norms is
    the line itself, so from the tenth observation on the forecast continues it (up to τ steps ahead, within
    the observed range ± log 4). The old test S0 ≥ min(10, τ) never held at τ = 10 (S0 = 10·(1 − 0.9^n)):
    the forecast stayed flat at the weighted mean of the past norms."""
    policy = BudgetedDQSGD(10 ** 9, total_steps, 1000, fixed_cost(1000))
    tau, lam = policy.tau, 1.0 - 1.0 / policy.tau
    assert tau == 10.0
    fit, slope, level = policy.init().fit, math.log(0.8), math.log(0.5)
    for n in range(12):
        fit = _observe(fit, float(n), level + slope * n, lam)
        forecast = forecast_norms(fit, n, n + 1, total_steps, math.exp(level + slope * n), tau)
        js = np.arange(n + 1, total_steps, dtype=np.float64)
        line = level + slope * (n + np.minimum(js - n, tau))
        want = np.exp(np.clip(line, level + slope * n - math.log(4.0), level + math.log(4.0)))
        if n >= 9:  # ten observations
            np.testing.assert_allclose(forecast, want, rtol=1e-9)
        else:
            np.testing.assert_array_equal(forecast, np.full(js.size, forecast[0]))  # flat before ten
    assert trend_count(20.0) == 10.0 and trend_count(75.0) == 10.0  # N > 200: the test as it was
