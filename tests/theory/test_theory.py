"""dqsgd.theory against Monte-Carlo: the quantizer's variance, Theorems 1–3, and the bit rules.

Every Monte-Carlo comparison uses a tolerance of 5 standard errors of the estimator. The reference
quantizer below is written from eqs. (3)–(4) and does not depend on dqsgd.quantizers.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dqsgd.theory.formulas as T

F64 = torch.float64


def su_quantize(g: torch.Tensor, s: int, p: float, gen: torch.Generator) -> torch.Tensor:
    """Stochastic uniform quantizer, eqs. (3)–(4), row-wise on (..., d)."""
    r = torch.linalg.vector_norm(g, ord=p, dim=-1, keepdim=True)
    y = s * g.abs() / torch.where(r > 0, r, torch.ones_like(r))
    low = torch.floor(y)
    up = (torch.rand(y.shape, generator=gen, dtype=F64) < y - low).to(F64)
    return torch.sign(g) * r * (low + up) / s


def assert_mc(samples: torch.Tensor, expected: float, what: str) -> None:
    mean, se = float(samples.mean()), float(samples.std() / math.sqrt(samples.numel()))
    assert abs(mean - expected) <= 5 * se + 1e-12 * abs(expected), f"{what}: MC {mean} ± {se} vs {expected}"


def random_spd(eigs: list[float], gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), generator=gen, dtype=F64))
    return q @ torch.diag(torch.tensor(eigs, dtype=F64)) @ q.T


# ---------------------------------------------------------------- Proposition 1

@pytest.mark.parametrize("d,s,p", [(7, 1, 2.0), (7, 3, math.inf), (13, 7, 2.0), (13, 127, 1.0)])
def test_exact_variance_matches_monte_carlo(d: int, s: int, p: float) -> None:
    gen = torch.Generator().manual_seed(100 + d + s)
    g = torch.randn(d, generator=gen, dtype=F64)
    exact = T.exact_quantization_variance(g, s, p)
    q = su_quantize(g.expand(40_000, d), s, p, gen)
    assert_mc(((q - g) ** 2).sum(1), exact, f"E|Q-g|^2 d={d} s={s} p={p}")
    r = float(torch.linalg.vector_norm(g, ord=p))
    assert exact <= T.worst_case_quantization_variance(r, s, d)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=40),
       st.integers(2, 10), st.sampled_from([1.0, 2.0, math.inf]))
def test_exact_variance_within_worst_case(xs: list[float], bits: int, p: float) -> None:
    g = torch.tensor(xs, dtype=F64)
    s = T.levels_for_bits(bits)
    v = T.exact_quantization_variance(g, s, p)
    r = float(torch.linalg.vector_norm(g, ord=p))
    assert 0.0 <= v <= T.worst_case_quantization_variance(r, s, len(xs)) * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=30), st.floats(1e-3, 1e3))
def test_vector_on_the_grid_has_zero_variance(levels: list[int], scale: float) -> None:
    s = 7
    q = torch.tensor(levels + [s], dtype=F64)  # max level s, so ‖g‖_∞ = scale exactly
    g = scale * q / s * torch.where(torch.arange(len(q)) % 2 == 0, 1.0, -1.0)
    # At a grid point f is 0 or 1 up to an ulp, so f(1 − f) ~ 1e-16.
    assert T.exact_quantization_variance(g, s, math.inf) <= 1e-14 * scale**2 * len(q)
    assert T.exact_quantization_variance(torch.zeros(5), s, 2.0) == 0.0


def test_mid_cell_vector_reaches_worst_case() -> None:
    # p = 1, s = 3: |g|/‖g‖₁ = (1/6, 5/6), so s|g_i|/‖g‖₁ = (0.5, 2.5), f_i = ½: 1.5 × Prop. 1.
    g = torch.tensor([1.0, -5.0], dtype=F64)
    v = T.exact_quantization_variance(g, 3, 1.0)
    assert v == pytest.approx(T.worst_case_quantization_variance(6.0, 3, 2))
    assert v == pytest.approx(1.5 * T.quantization_variance_bound(6.0, 3, 2))


@pytest.mark.parametrize("p", [2.0, math.inf])
def test_proposition1_average_over_cell_uniform_vectors(p: float) -> None:
    # d = 64, s = 127: s|g_i|/‖g‖ spreads over many cells, so the fractional parts are ≈ uniform.
    d, s, R = 64, 127, 4000
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(R, d, generator=gen, dtype=F64)
    r = torch.linalg.vector_norm(g, ord=p, dim=1)
    prop1 = sum(T.quantization_variance_bound(float(x), s, d) for x in r) / R
    exact = sum(T.exact_quantization_variance(row, s, p) for row in g) / R
    mc = float(((su_quantize(g, s, p, gen) - g) ** 2).sum(1).mean())
    assert abs(exact / prop1 - 1) < 0.03 and abs(mc / prop1 - 1) < 0.03, (prop1, exact, mc)


@settings(max_examples=50, deadline=None)
@given(st.floats(1.0, 16.0))
def test_levels_bits_round_trip(bits: float) -> None:
    assert T.bits_for_levels(T.levels_for_bits(bits)) == pytest.approx(bits, rel=1e-12)
    assert T.levels_for_bits(1) == 0 and T.levels_for_bits(3) == 3 and T.levels_for_bits(8) == 127


# ---------------------------------------------------------------- Theorem 2

def _simulate_gaussian(H: torch.Tensor, A: torch.Tensor, x0: torch.Tensor, eta: float,
                       cov: torch.Tensor, R: int, gen: torch.Generator) -> torch.Tensor:
    """F(x_N) − F* over R runs of x_{n+1} = x_n − η(Hx_n + A) − ηε_n, F = ½xᵀHx + Aᵀx + 3."""
    chol = torch.linalg.cholesky(cov)
    x = x0.expand(R, -1).clone()
    for n in range(cov.shape[0]):
        eps = torch.randn(R, x.shape[1], generator=gen, dtype=F64) @ chol[n].T
        x = x - eta * (x @ H + A) - eta * eps
    F = lambda z: 0.5 * ((z @ H) * z).sum(-1) + z @ A + 3.0  # noqa: E731
    return F(x) - F(-torch.linalg.solve(H, A))


def _literal_theorem2(e0: torch.Tensor, H: torch.Tensor, eta: float, cov: torch.Tensor) -> float:
    N, rho = cov.shape[0], torch.eye(H.shape[0], dtype=F64) - eta * H
    pw = lambda k: torch.linalg.matrix_power(rho, k)  # noqa: E731
    out = 0.5 * e0 @ pw(N).T @ H @ pw(N) @ e0
    return float(out + 0.5 * eta**2 * sum(torch.trace(pw(N - 1 - n) @ cov[n] @ H @ pw(N - 1 - n).T)
                                          for n in range(N)))


@pytest.mark.parametrize("eigs", [[0.5, 1.0, 1.7, 2.5, 4.0], [2.0] * 5])
def test_theorem2_matches_simulation(eigs: list[float]) -> None:
    d, N, eta = 5, 30, 0.12
    gen = torch.Generator().manual_seed(2)
    H = random_spd(eigs, gen)
    A, x0 = torch.randn(d, generator=gen, dtype=F64), 2 * torch.randn(d, generator=gen, dtype=F64)
    M = torch.randn(N, d, d, generator=gen, dtype=F64)
    cov = (M @ M.transpose(1, 2) / d) * (1 + torch.arange(N, dtype=F64) / N).view(N, 1, 1)
    e0 = x0 + torch.linalg.solve(H, A)
    formula = T.theorem2_expected_error(e0, H, eta, cov)
    assert formula == pytest.approx(_literal_theorem2(e0, H, eta, cov), rel=1e-10)
    assert_mc(_simulate_gaussian(H, A, x0, eta, cov, 100_000, gen), formula, "Theorem 2")
    if len(set(eigs)) == 1:
        traces = torch.diagonal(cov, dim1=1, dim2=2).sum(1)
        iso = T.theorem2_isotropic(float(e0 @ e0), eigs[0], eta, traces)
        assert iso == pytest.approx(formula, rel=1e-10)


# ---------------------------------------------------------------- Theorems 1 and 3

def test_theorem1_isotropic_bounds_coincide_and_equal_theorem2() -> None:
    lam, eta, d, K, sigma2, dist0 = 2.0, 0.1, 10, 8, 3.0, 4.0
    norms, bits = [3.0, 2.0, 1.5, 1.0, 0.7, 0.5], [2, 3, 3, 4, 5.5, 6]
    args = (0.5 * lam * dist0, lam, lam, eta, sigma2, K, d, norms, bits)
    up, lo = T.theorem1_upper_terms(*args), T.theorem1_lower_terms(*args)
    for a, b in zip(up, lo):
        assert a == pytest.approx(b, rel=1e-12)
    traces = [sigma2 / K + T.quantization_variance_bound(g, T.levels_for_bits(b), d)
              for g, b in zip(norms, bits)]
    assert up.total == pytest.approx(T.theorem2_isotropic(dist0, lam, eta, traces), rel=1e-12)


def _check_lower_le_upper(mu: float, L: float, eta: float, N: int, sigma2: float, K: int,
                          norms: list[float], bits: list[int], gap: float) -> None:
    args = (gap, L, mu, eta, sigma2, K, 100, norms, bits)
    lo, up = T.theorem1_lower_terms(*args), T.theorem1_upper_terms(*args)
    assert all(b >= 0.0 for b in up), up  # bounds on non-negative quantities
    assert all(a <= b * (1 + 1e-12) for a, b in zip(lo, up)), (lo, up)


@settings(max_examples=200, deadline=None)
@given(st.floats(0.05, 1.0), st.floats(1.0, 20.0), st.floats(0.01, 1.0), st.integers(1, 40),
       st.floats(0.0, 5.0), st.integers(1, 64), st.data())
def test_theorem1_lower_le_upper(mu: float, kappa: float, frac: float, N: int, sigma2: float,
                                 K: int, data: st.DataObject) -> None:
    L = mu * kappa
    eta = frac * T.theorem1_lower_max_eta(L, mu)  # keeps β ≥ 0
    norms = data.draw(st.lists(st.floats(0.0, 100.0), min_size=N, max_size=N))
    bits = data.draw(st.lists(st.integers(2, 16), min_size=N, max_size=N))
    _check_lower_le_upper(mu, L, eta, N, sigma2, K, norms, bits, data.draw(st.floats(0.0, 1e3)))


@pytest.mark.parametrize("mu", [0.875, 0.3, 0.05, 1.0])
def test_theorem1_bounds_at_eta_mu_one(mu: float) -> None:
    # L = μ, η = 1/μ: α = β = 0 exactly; the literal 1 − 2μη + Lμη² rounds to −1.1e-16 at μ = 0.875.
    alpha, beta = T.theorem1_alpha_beta(mu, mu, 1.0 / mu)
    assert 0.0 <= alpha < 1e-15 and beta == alpha
    _check_lower_le_upper(mu, mu, 1.0 / mu, 1, 0.0, 1, [0.0], [2], 1.0)


@settings(max_examples=100, deadline=None)
@given(st.floats(1e-3, 1e3), st.floats(1e-9, 1.0), st.floats(0.0, 2.0))
def test_theorem1_rates_are_ordered_and_stable(L: float, ratio: float, frac: float) -> None:
    mu, eta = L * ratio, frac / L
    alpha, beta = T.theorem1_alpha_beta(L, mu, eta)
    assert alpha >= 0.0 and beta <= alpha
    lit_a, lit_b = 1 - 2 * mu * eta + L * mu * eta**2, 1 - 2 * L * eta + L * mu * eta**2
    assert alpha == pytest.approx(lit_a, abs=1e-12) and beta == pytest.approx(lit_b, abs=1e-12)
    # β vanishes at the largest admissible η, to rounding (the literal (1 − √(1 − μ/L))/μ loses
    # every digit when μ/L ≲ 1e-16).
    e_max = T.theorem1_lower_max_eta(L, mu)
    assert 0.5 / L <= e_max <= 1.0 / L
    assert abs(T.theorem1_alpha_beta(L, mu, e_max)[1]) <= 1e-12


def test_theorem1_geometric_sum_is_monotone_near_one() -> None:
    # (1 − r^N)/(1 − r) at r = 1 − 1e-15 is off by percents; the term-by-term sum is not.
    r = 1.0 - 1e-15
    assert T._geom(r, 1000) == pytest.approx(1000.0, rel=1e-9)
    assert T._geom(r, 1000) <= T._geom(1.0, 1000) == 1000.0


def test_theorem1_lower_rejects_negative_beta() -> None:
    with pytest.raises(ValueError, match="beta"):
        T.theorem1_lower(1.0, 4.0, 1.0, 0.2, 0.0, 1, 5, [1.0], [4])


@pytest.fixture(scope="module")
def qsgd_runs() -> dict[str, object]:
    """Noise-free QSGD (σ = 0), B = 3 bits (s = 3), p = 2, on ½xᵀHx + Aᵀx, d = 5, μ = 1, L = 4."""
    d, N, eta, R, s = 5, 25, 0.1, 20_000, 3
    gen = torch.Generator().manual_seed(11)
    H = random_spd([1.0, 1.5, 2.0, 3.0, 4.0], gen)
    A, x0 = torch.randn(d, generator=gen, dtype=F64), 2 * torch.randn(d, generator=gen, dtype=F64)
    xs = -torch.linalg.solve(H, A)
    x = x0.expand(R, d).clone()
    grad_sq, cov_diag = torch.zeros(R, N, dtype=F64), torch.zeros(N, d, dtype=F64)
    for n in range(N):
        g = x @ H + A
        grad_sq[:, n] = (g * g).sum(1)
        r = torch.linalg.vector_norm(g, dim=1, keepdim=True)
        f = s * g.abs() / r - torch.floor(s * g.abs() / r)
        cov_diag[n] = ((r / s) ** 2 * f * (1 - f)).mean(0)  # E Cov(Q(g) − g | x_n), diagonal
        x = x - eta * su_quantize(g, s, 2.0, gen)
    e = x - xs
    e0 = x0 - xs
    return dict(H=H, e0=e0, eta=eta, d=d, bits=[s + 1] * N, gap0=0.5 * float(e0 @ H @ e0),
                final=0.5 * ((e @ H) * e).sum(1), grad_sq=grad_sq, cov_diag=cov_diag)


def test_theorem1_brackets_simulated_qsgd(qsgd_runs: dict) -> None:
    r = qsgd_runs
    norms = r["grad_sq"].mean(0).sqrt()  # RMS over runs: the proof's E‖g(x_n)‖²
    args = (r["gap0"], 4.0, 1.0, r["eta"], 0.0, 1, r["d"], norms, r["bits"])
    lo, up = T.theorem1_lower(*args), T.theorem1_upper(*args)
    up_rigorous = T.theorem1_upper(*args, cell_factor=0.25)
    final = r["final"]
    mean, se = float(final.mean()), float(final.std()) / math.sqrt(final.numel())
    print(f"\nTheorem 1: lower {lo:.5g} <= measured {mean:.5g} ± {se:.2g} <= upper {up:.5g}"
          f" (1/4: {up_rigorous:.5g})")
    assert lo < mean - 5 * se and mean + 5 * se < up <= up_rigorous
    # The noise-driven part alone (measured minus the noise-free run) lies between the quantization terms.
    zero_cov = torch.zeros(len(r["bits"]), 5, 5)
    noise_free = T.theorem2_expected_error(r["e0"], r["H"], r["eta"], zero_cov)
    lo_q, up_q = T.theorem1_lower_terms(*args).quantization, T.theorem1_upper_terms(*args).quantization
    print(f"quantization part: {lo_q:.3g} <= {mean - noise_free:.3g} <= {up_q:.3g}")
    assert lo_q < mean - noise_free - 5 * se and mean - noise_free + 5 * se < up_q
    # On a quadratic, Theorem 2 is exact for the (non-Gaussian, state-dependent) quantization noise.
    exact = T.theorem2_expected_error(r["e0"], r["H"], r["eta"], torch.diag_embed(r["cov_diag"]))
    print(f"Theorem 2 with measured quantization covariances: {exact:.5g}")
    assert abs(mean - exact) <= 5 * se


def test_theorem3_bounds_simulated_qsgd(qsgd_runs: dict) -> None:
    r = qsgd_runs
    norms = r["grad_sq"].mean(0).sqrt()
    args = (r["gap0"], 4.0, r["eta"], 0.0, 1, r["d"], norms, r["bits"])
    avg = r["grad_sq"].mean(1)  # (1/N)Σ_n ‖∇F(x_n)‖² per run
    bound = T.theorem3_upper(*args, cell_factor=0.25)
    print(f"\nTheorem 3: measured {float(avg.mean()):.5g} <= bound {T.theorem3_upper(*args):.5g}"
          f" (1/4: {bound:.5g})")
    assert float(avg.mean()) + 5 * float(avg.std()) / math.sqrt(avg.numel()) <= T.theorem3_upper(*args)


# ---------------------------------------------------------------- bit allocation

def _problem(N: int = 40, d: int = 1000, mean_bits: float = 5.0, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    norms = torch.exp(torch.randn(N, generator=gen, dtype=F64))
    weights = T.convex_weights(N, 2.0, d, 0.05, 0.97)
    return norms, weights, d, N * (d * mean_bits + 32.0)


def test_optimal_real_bits_spends_c_and_beats_equal() -> None:
    norms, w, d, C = _problem()
    bits = T.optimal_real_bits(norms, w, d, C, 32.0)
    assert float((d * bits + 32.0).sum()) == pytest.approx(C, rel=1e-12)
    best = T.quantization_term(norms, bits, w)
    assert best < T.quantization_term(norms, [5.0] * len(norms), w)
    gen = torch.Generator().manual_seed(4)
    for _ in range(20):  # any budget-preserving perturbation is worse: a true optimum
        delta = 0.05 * torch.randn(len(norms), generator=gen, dtype=F64)
        assert T.quantization_term(norms, bits + delta - delta.mean(), w) > best


def test_optimal_real_bits_has_eq18_shape() -> None:
    norms, w, d, C = _problem(mean_bits=7.0)
    bits = T.optimal_real_bits(norms, w, d, C, 32.0)
    s = 2.0 ** (bits - 1) - 1
    shape = bits - torch.log2(norms) - 0.5 * torch.log2(w)
    kkt = shape - 1.5 * torch.log2(1 + 1 / s)  # exact Lagrange condition: constant
    assert float(kkt.max() - kkt.min()) < 1e-9
    assert float(shape.max() - shape.min()) <= 1.5 * math.log2(1 + 1 / float(s.min())) + 1e-9
    # eq. (18) with its k fitted: s_n = k·α^((N−n)/2)‖g_n‖, to within the dropped "+1" (O(1/s)).
    n, N = torch.arange(len(norms), dtype=F64), len(norms)
    k = float((s / (0.97 ** ((N - n) / 2) * norms)).median())
    assert torch.allclose(T.dqsgd_convex_bits(norms, k, 0.97), bits, atol=3 / float(s.min()))


def test_optimal_real_bits_zero_norms_and_infeasible_budget() -> None:
    norms, w, d, _ = _problem(N=6)
    norms[2] = 0.0
    bits = T.optimal_real_bits(norms, w, d, 6 * (d * 4 + 32.0), 32.0)
    assert float(bits[2]) == 1.0 and float(bits.sum()) == pytest.approx(24.0, rel=1e-12)
    with pytest.raises(ValueError, match="must exceed"):
        T.optimal_real_bits(norms, w, d, 6 * (d * 1 + 32.0), 32.0)


def test_error_target_meets_eps_q() -> None:
    norms, _, d, _ = _problem()
    N, L, eta, alpha, eps = len(norms), 2.0, 0.05, 0.97, 1e-4
    k = T.error_target_k(N, L, d, eta, alpha, eps)
    w = T.convex_weights(N, L, d, eta, alpha)
    real = T.dqsgd_convex_bits(norms, k, alpha)
    assert T.quantization_term(norms, real, w) == pytest.approx(eps, rel=1e-10)
    assert T.quantization_term(norms, torch.ceil(real), w) <= eps  # integerizing up only helps
    t = T.error_target_t(L, eta, d, eps)
    wn = T.nonconvex_weights(N, L, d, eta)
    assert T.quantization_term(norms, T.dqsgd_nonconvex_bits(norms, t), wn) == pytest.approx(eps, rel=1e-10)


def test_fixed_vs_dynamic_am_gm() -> None:
    norms, w, d, C = _problem(mean_bits=12.0)
    fixed, dynamic = T.fixed_vs_dynamic(norms, w, 12.0)
    assert dynamic < fixed
    assert fixed == pytest.approx(T.quantization_term(norms, [12.0] * len(norms), w), rel=1e-2)
    exact = T.quantization_term(norms, T.optimal_real_bits(norms, w, d, C, 32.0), w)
    assert dynamic == pytest.approx(exact, rel=1e-2)  # s ≈ 2^(B−1) at 12 bits
    flat = 1 / torch.sqrt(w)  # v_n = w_n‖g_n‖² constant: AM = GM
    fx, dy = T.fixed_vs_dynamic(flat, w, 6.0)
    assert dy == pytest.approx(fx, rel=1e-12)
    # Geometric profile ‖g_n‖² ∝ α^(γn) gives the sums of eqs. (23)/(24).
    N, alpha, gamma = len(norms), 0.97, 1.8
    g = alpha ** (gamma * torch.arange(N, dtype=F64) / 2)
    fx, dy = T.fixed_vs_dynamic(g, w, 6.0)
    c = float(w[-1]) * alpha ** (N - 1) / 4.0**5
    assert fx == pytest.approx(c * sum(alpha ** ((gamma - 1) * n) for n in range(N)), rel=1e-12)
    assert dy == pytest.approx(c * N * alpha ** ((gamma - 1) * (N - 1) / 2), rel=1e-12)
