"""The DQSGD paper's bounds (ICLR 2021 submission) as plain functions, to set beside measurements.

Inputs are floats and 1-D sequences (lists or tensors); outputs are floats or float64 tensors of
per-step values. Conventions (paper §3): a width of B bits is 1 sign bit + (B−1) level bits, so
s = 2^(B−1) − 1 levels; widths may be real (continuous relaxation). ``norms`` are ‖g(x_n)‖_p for
n = 0..N−1. The proofs bound an expectation over runs, in which ‖g(x_n)‖_p² enters as E‖g(x_n)‖_p²:
for a bound on a run average pass the root-mean-square sqrt(E‖g(x_n)‖_p²).

Reading notes:
* Proposition 1's E‖Q_s(g) − g‖² = d‖g‖_p²/(6s²) is an *average* over g, not a bound for every g
  (see :func:`quantization_variance_bound`). Theorems 1 and 3 use it; their functions take
  ``cell_factor`` (default 1/6, the paper) in E‖Q_s(g) − g‖² = cell_factor·d‖g‖_p²/s², and
  ``cell_factor=1/4`` gives an upper bound valid for every g.
* Theorem 2 writes F(x) = xᵀHx + Aᵀx + B but uses ∇F = Hx + A. Here F(x) = ½xᵀHx + Aᵀx + B.
* Appendix E, eqs. (23)–(28): the printed Assumption 4 (eq. 22) is garbled, so it is not clear which
  gradient-norm profile is assumed. What is clean and general is stated in :func:`fixed_vs_dynamic`:
  under s ≈ 2^(B−1), a fixed width pays N·AM and the optimal one N·GM of the numbers w_n‖g_n‖². If
  w_n‖g_n‖² is geometric in n, this is the shape of eqs. (23)–(28). Those equations are not given
  as such.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple

import torch

Floats = Sequence[float] | torch.Tensor


def _vec(x: Floats) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float64)
    if t.dim() != 1:
        raise ValueError(f"expected a 1-D sequence of per-step values, got shape {tuple(t.shape)}")
    return t


def _pair(a: Floats, b: Floats, names: str) -> tuple[torch.Tensor, torch.Tensor]:
    u, v = _vec(a), _vec(b)
    if u.numel() != v.numel():
        raise ValueError(f"{names}: lengths differ ({u.numel()} vs {v.numel()}); one value per step n")
    return u, v.to(u.device)


def _geom(r: float, n: int) -> float:
    """Σ_{k<n} r^k, summed term by term: (1 − r^n)/(1 − r) cancels catastrophically as r → 1, and
    each power is monotone in r, so a larger rate never gives a smaller sum."""
    return float(torch.pow(torch.tensor(r, dtype=torch.float64), torch.arange(n, dtype=torch.float64)).sum())


def real_levels(bits: float) -> float:
    """s = 2^(B−1) − 1 for a real width B (0 at B = 1): the theory's level count. The quantizers'
    integer count (:func:`dqsgd.quantizers.levels_for_bits`) differs at B = 1 only, where the
    stochastic binary quantizer has one level."""
    return 2.0 ** (bits - 1.0) - 1.0


levels_for_bits = real_levels  # the name the bounds below (and earlier code) use


def bits_for_levels(levels: Any, log2: Callable[[Any], Any] = math.log2) -> Any:
    """B = log2(s + 1) + 1, the inverse of :func:`real_levels`; real B allowed.

    DQSGD's width rule, written here once: B_n = log2(k·a_n·‖g_n‖_p + 1) + 1 (eq. 18, a_n = α^((N−n)/2);
    eq. 20, a_n = 1) is the width of s_n = k·a_n·‖g_n‖_p levels. ``log2``: ``math.log2``, ``np.log2``
    or ``torch.log2``, for the type of ``levels`` (the same floating-point operations in every case)."""
    return log2(levels + 1.0) + 1.0


# ---------------------------------------------------------------- Proposition 1: the noise

def quantization_variance_bound(norm_p: float, s: float, d: int) -> float:
    """Proposition 1 (eq. 13 and the line after it): E‖Q_s(g) − g‖² = d‖g‖_p²/(6s²).

    Assumption, stated precisely: write y_i = s|g_i|/‖g‖_p and f_i = y_i − ⌊y_i⌋. Each fractional
    part f_i is Uniform[0, 1) given ‖g‖_p, i.e. |g_i|/‖g‖_p is uniform within its level cell
    [l/s, (l+1)/s]. (Appendix A takes |g_i|/‖g‖_p ~ U(l/s, (l+1)/s).) The noise ε_i then has the
    triangular density of eq. (13), and E[f(1−f)] = 1/6. So this is an average over such g, not a
    bound for each g. Mid-cell magnitudes (f_i = ½) reach :func:`worst_case_quantization_variance`,
    which is 1.5 times larger, and g on the grid gives 0. With p = ∞ the largest coordinate always
    has f = 0, so at most d − 1 coordinates can satisfy the assumption.
    """
    return d * norm_p**2 / (6.0 * s**2)


def worst_case_quantization_variance(norm_p: float, s: float, d: int) -> float:
    """d‖g‖_p²/(4s²) ≥ E‖Q_s(g) − g‖² for every g and every p ≥ 1, since f(1−f) ≤ 1/4."""
    return d * norm_p**2 / (4.0 * s**2)


def exact_quantization_variance(g: torch.Tensor, s: float, p: float = 2.0) -> float:
    """E‖Q_s(g) − g‖² for the stochastic uniform quantizer of eqs. (3)–(4), in closed form.

    Coordinate i rounds y_i = s|g_i|/‖g‖_p up with probability f_i = y_i − ⌊y_i⌋ and down
    otherwise. The step is ‖g‖_p/s, so the variance of coordinate i is (‖g‖_p/s)²·f_i(1 − f_i):

        E‖Q_s(g) − g‖² = Σ_i (‖g‖_p/s)² f_i(1 − f_i).     (0 for g = 0)
    """
    if s < 1:
        raise ValueError(f"need s >= 1 quantization levels (B >= 2 bits), got s={s}")
    v = g.detach().to(torch.float64).flatten()
    r = torch.linalg.vector_norm(v, ord=p)
    if float(r) == 0.0:
        return 0.0
    y = s * v.abs() / r
    f = y - torch.floor(y)
    return float((r / s) ** 2 * (f * (1.0 - f)).sum())


def two_stage_variance_bound(worker_norms: Floats, d: int, up_bits: float, down_bits: float | None, *,
                             cell_factor: float = 0.25) -> float:
    """E‖G − ḡ‖² for the two-stage (sharded) estimator of one shard of ``d`` coordinates.

    G = Q_d(Ĝ), Ĝ = (1/W) Σ_w Q_up(g_w), ḡ = (1/W) Σ_w g_w; ``worker_norms`` are ‖g_w‖_p over the
    shard (the norm the uplink quantizer scales by), W = len(worker_norms). Both stages are
    unbiased and draw independent uniforms, so the cross terms vanish and

        E‖G − ḡ‖² = (1/W²) Σ_w E‖Q_up(g_w) − g_w‖² + E‖Q_d(Ĝ) − Ĝ‖²
                  ≤ c·d/s_up² · (1/W²) Σ_w ‖g_w‖_p²  +  c·d/s_d² · ((1/W) Σ_w ‖g_w‖_p)²,

    each stage by the quantizer variance formula c·d‖x‖²/s² (Proposition 1's form; c = 1/4 holds for
    every x, c = 1/6 is the paper's average). The downlink scales by ‖Ĝ‖_∞, and every decoded
    coordinate of Q_up(g_w) has magnitude ≤ ‖g_w‖_p, so ‖Ĝ‖_∞ ≤ (1/W) Σ_w ‖g_w‖_p for sure.
    With equal norms ‖g_w‖ = ‖g‖ this is c·d‖g‖²·(1/(W s_up²) + 1/s_d²): the uplink variance over
    W plus the downlink's. ``down_bits=None``: an fp32 downlink (no second term). Sum over shards
    for the whole vector.
    """
    g = _vec(worker_norms)
    if g.numel() < 1:
        raise ValueError("need at least one worker norm")
    W = g.numel()
    up = cell_factor * d * float((g**2).sum()) / (W**2 * levels_for_bits(up_bits) ** 2)
    if down_bits is None:
        return up
    return up + cell_factor * d * float(g.mean()) ** 2 / levels_for_bits(down_bits) ** 2


def two_stage_quantization_term(norms: Floats, bits: Floats, weights: Floats, workers: int,
                                down_bits: float | None) -> float:
    """Theorems 1/3's quantization term for the sharded topology: Σ_n w_n‖g_n‖²·(1/(W s_n²) + 1/s_d²).

    The single-stage term (:func:`quantization_term`) charges w_n‖g_n‖²/s_n² for one quantized
    gradient; averaging W independent uplinks divides that by W, and the downlink's re-quantization
    of the average adds w_n‖g_n‖²/s_d² (:func:`two_stage_variance_bound` with equal worker norms).
    ``down_bits=None`` (fp32 downlink) leaves the uplink part alone.
    """
    if workers < 1:
        raise ValueError(f"need workers >= 1, got {workers}")
    g, _ = _pair(norms, bits, "norms/bits")
    up = quantization_term(norms, bits, weights) / workers
    if down_bits is None:
        return up
    _, w = _pair(norms, weights, "norms/weights")
    return up + float((w * g**2).sum()) / levels_for_bits(down_bits) ** 2


# ---------------------------------------------------------------- Theorems 1 and 3

class BoundTerms(NamedTuple):
    """The three parts of a convergence bound; ``total`` is their sum."""

    optimization: float  # the gradient-descent part from F(x_0) − F*: → 0 as N grows
    sampling: float      # minibatch noise σ²/K
    quantization: float  # Σ_n w_n ‖g_n‖²/s_n², the part that DQSGD minimizes

    @property
    def total(self) -> float:
        return self.optimization + self.sampling + self.quantization


def theorem1_alpha_beta(L: float, mu: float, eta: float) -> tuple[float, float]:
    """Theorem 1's rates: α = 1 − 2μη + Lμη², β = 1 − 2Lη + Lμη² (α = β when L = μ).

    Evaluated without cancellation: α = (1 − μη)² + μη²(L − μ), a sum of non-negative terms (at
    μη = 1, L = μ the literal form rounds to −1e-16 and the "upper bound" goes negative), and
    β = α − 2η(L − μ), so that β ≤ α holds in floating point as it does exactly.
    """
    alpha = (1.0 - mu * eta) ** 2 + mu * eta**2 * (L - mu)
    return alpha, alpha - 2.0 * eta * (L - mu)


def theorem1_lower_max_eta(L: float, mu: float) -> float:
    """The largest η with β ≥ 0: (1 − √(1 − μ/L))/μ, written as 1/(L(1 + √(1 − μ/L))), which
    does not cancel when μ ≪ L."""
    return 1.0 / (L * (1.0 + math.sqrt(1.0 - mu / L)))


def convex_weights(N: int, L: float, d: int, eta: float, alpha: float) -> torch.Tensor:
    """Theorem 1's quantization weights w_n = (L d η²/12)·α^(N−1−n), n = 0..N−1.

    (μ and β in place of L and α give the lower bound's weights.)
    """
    n = torch.arange(N, dtype=torch.float64)
    return (L * d * eta**2 / 12.0) * alpha ** (N - 1 - n)


def nonconvex_weights(N: int, L: float, d: int, eta: float) -> torch.Tensor:
    """Theorem 3's quantization weights w_n = L η d/(6(2 − Lη)N), the same for every n."""
    return torch.full((N,), L * eta * d / (6.0 * (2.0 - L * eta) * N), dtype=torch.float64)


def quantization_term(norms: Floats, bits: Floats, weights: Floats) -> float:
    """Σ_n w_n‖g_n‖_p²/s_n² with s_n = 2^(B_n−1) − 1. A step with ‖g_n‖ = 0 adds 0 for any B_n."""
    g, b = _pair(norms, bits, "norms/bits")
    _, w = _pair(norms, weights, "norms/weights")
    s = 2.0 ** (b - 1.0) - 1.0
    return float(torch.where(g > 0, w * g**2 / s**2, torch.zeros_like(g)).sum())


def _check_step(L: float, mu: float, eta: float) -> None:
    if not 0 < mu <= L:
        raise ValueError(f"need 0 < mu <= L, got mu={mu}, L={L}")
    if not 0 < eta <= 2.0 / L:
        raise ValueError(f"need 0 < eta <= 2/L = {2.0 / L}, got eta={eta} (else α ≥ 1, no descent)")


def _convex_terms(gap: float, c: float, eta: float, sigma2: float, K: int, d: int,
                  norms: Floats, bits: Floats, rate: float, cell_factor: float) -> BoundTerms:
    N = _vec(norms).numel()
    w = convex_weights(N, c, d, eta, rate)
    return BoundTerms(rate**N * gap, c * eta**2 * sigma2 / (2.0 * K) * _geom(rate, N),
                      6.0 * cell_factor * quantization_term(norms, bits, w))


def theorem1_upper_terms(F0_gap: float, L: float, mu: float, eta: float, sigma2: float, K: int,
                         d: int, norms: Floats, bits: Floats, *,
                         cell_factor: float = 1 / 6) -> BoundTerms:
    """Theorem 1, upper bound (Appendix B), for L-smooth, μ-strongly convex F, 0 < η ≤ 2/L:

        E[F(x_N) − F*] ≤ α^N (F(x_0) − F*) + Lη²σ²(1 − α^N)/(2K(1 − α))
                         + (L d η²/12) Σ_n α^(N−1−n) ‖g(x_n)‖_p²/s_n².

    The last term assumes E‖Q − g‖² ≤ d‖g‖²/(6s²) (Proposition 1). ``cell_factor`` replaces the 1/6.
    """
    _check_step(L, mu, eta)
    alpha, _ = theorem1_alpha_beta(L, mu, eta)
    return _convex_terms(F0_gap, L, eta, sigma2, K, d, norms, bits, alpha, cell_factor)


def theorem1_lower_terms(F0_gap: float, L: float, mu: float, eta: float, sigma2: float, K: int,
                         d: int, norms: Floats, bits: Floats, *,
                         cell_factor: float = 1 / 6) -> BoundTerms:
    """Theorem 1, lower bound (Appendix B):

        E[F(x_N) − F*] ≥ β^N (F(x_0) − F*) + μη²σ²(1 − β^N)/(2K(1 − β))
                         + (μ d η²/12) Σ_n β^(N−1−n) ‖g(x_n)‖_p²/s_n².

    The proof uses the noise variances *with equality*: sampling σ²/K, quantization
    cell_factor·d‖g‖²/s². So it is a bound only when the true variances are at least that large.
    To unroll the recursion it also needs β ≥ 0, i.e. η ≤ (1 − √(1 − μ/L))/μ
    (:func:`theorem1_lower_max_eta`), checked here.
    """
    _check_step(L, mu, eta)
    _, beta = theorem1_alpha_beta(L, mu, eta)
    if beta < -1e-12:  # tolerance: η exactly at the boundary may round β to −1e-16
        raise ValueError(f"lower bound needs beta >= 0, i.e. eta <= (1-sqrt(1-mu/L))/mu = "
                         f"{theorem1_lower_max_eta(L, mu):.6g}; got eta={eta}, beta={beta}")
    return _convex_terms(F0_gap, mu, eta, sigma2, K, d, norms, bits, max(beta, 0.0), cell_factor)


def theorem1_upper(F0_gap: float, L: float, mu: float, eta: float, sigma2: float, K: int, d: int,
                   norms: Floats, bits: Floats, *, cell_factor: float = 1 / 6) -> float:
    """Theorem 1's upper bound on E[F(x_N) − F*]; see :func:`theorem1_upper_terms`."""
    return theorem1_upper_terms(F0_gap, L, mu, eta, sigma2, K, d, norms, bits,
                                cell_factor=cell_factor).total


def theorem1_lower(F0_gap: float, L: float, mu: float, eta: float, sigma2: float, K: int, d: int,
                   norms: Floats, bits: Floats, *, cell_factor: float = 1 / 6) -> float:
    """Theorem 1's lower bound on E[F(x_N) − F*]; see :func:`theorem1_lower_terms`."""
    return theorem1_lower_terms(F0_gap, L, mu, eta, sigma2, K, d, norms, bits,
                                cell_factor=cell_factor).total


def theorem3_terms(F0_gap: float, L: float, eta: float, sigma2: float, K: int, d: int,
                   norms: Floats, bits: Floats, *, cell_factor: float = 1 / 6) -> BoundTerms:
    """Theorem 3 (eq. 19, Appendix D), L-smooth F, 0 < η < 2/L:

        (1/N) Σ_n E‖∇F(x_n)‖² ≤ 2(F(x_0) − F*)/(Nη(2 − Lη)) + Lησ²/((2 − Lη)K)
                                + (L η d/(6(2 − Lη)N)) Σ_n ‖g(x_n)‖_p²/s_n².
    """
    if not (eta > 0 and L * eta < 2.0):  # L·η, not η < 2/L: the η just below 2/L may round L·η to 2
        raise ValueError(f"Theorem 3 needs 0 < eta < 2/L = {2.0 / L}, got eta={eta}")
    N = _vec(norms).numel()
    w = nonconvex_weights(N, L, d, eta)
    return BoundTerms(2.0 * F0_gap / (N * eta * (2.0 - L * eta)),
                      L * eta * sigma2 / ((2.0 - L * eta) * K),
                      6.0 * cell_factor * quantization_term(norms, bits, w))


def theorem3_upper(F0_gap: float, L: float, eta: float, sigma2: float, K: int, d: int,
                   norms: Floats, bits: Floats, *, cell_factor: float = 1 / 6) -> float:
    """Theorem 3's bound on (1/N) Σ_n E‖∇F(x_n)‖²; see :func:`theorem3_terms`."""
    return theorem3_terms(F0_gap, L, eta, sigma2, K, d, norms, bits, cell_factor=cell_factor).total


# ---------------------------------------------------------------- Theorem 2: quadratics

def theorem2_expected_error(x0_minus_xstar: torch.Tensor, H: torch.Tensor, eta: float,
                            covariances: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """Theorem 2 (eq. 17, Appendix C): E[F(x_N) − F*] for F(x) = ½xᵀHx + Aᵀx + B (H the Hessian)
    under x_{n+1} = x_n − η(Hx_n + A) − ηε_n, Cov ε_n = Σ_n (``covariances``: N matrices d×d):

        ½ e_0ᵀ (ρ^N)ᵀ H ρ^N e_0 + (η²/2) Σ_n Tr[ρ^(N−1−n) Σ_n H (ρ^(N−1−n))ᵀ],   ρ = I − ηH.

    Computed in H's eigenbasis (H = QΛQᵀ): Tr[ρ^k Σ H ρ^k] = Σ_j λ_j(1 − ηλ_j)^(2k)(QᵀΣQ)_jj.
    Gaussianity is not needed. The identity is exact for any noise with E[ε_n | past] = 0 and
    E[ε_n ε_nᵀ] = Σ_n. With state-dependent noise, Σ_n is the mean of Σ(x_n) over runs.
    """
    Hd = H.to(torch.float64)
    if not torch.allclose(Hd, Hd.T):
        raise ValueError("H must be symmetric (it is the Hessian of F)")
    cov = (covariances if isinstance(covariances, torch.Tensor)
           else torch.stack(list(covariances))).to(torch.float64)
    if cov.dim() != 3 or cov.shape[1:] != Hd.shape:
        raise ValueError(f"covariances must be (N, d, d) with d = {Hd.shape[0]}, got {tuple(cov.shape)}")
    lam, Q = torch.linalg.eigh(Hd)
    N = cov.shape[0]
    r2 = (1.0 - eta * lam) ** 2
    e = Q.T @ x0_minus_xstar.to(torch.float64).flatten()
    init = 0.5 * float((lam * r2**N * e**2).sum())
    diag = torch.einsum("ij,nik,kj->nj", Q, cov, Q)  # (QᵀΣ_nQ)_jj
    k = (N - 1 - torch.arange(N, dtype=torch.float64)).unsqueeze(1)
    return init + 0.5 * eta**2 * float((lam * r2**k * diag).sum())


def theorem2_isotropic(dist0_sq: float, lam: float, eta: float, noise_traces: Floats) -> float:
    """Theorem 2 closed form for H = λI, with ``noise_traces[n]`` = Tr Σ_n = E‖ε_n‖²:

        E[F(x_N) − F*] = ½λ(1 − ηλ)^(2N) ‖x_0 − x*‖² + (η²λ/2) Σ_n (1 − ηλ)^(2(N−1−n)) Tr Σ_n.

    Only the traces matter, so Σ_n need not be isotropic. With Tr Σ_n = σ²/K + d‖g_n‖²/(6s_n²) this
    is Theorem 1 with L = μ = λ, where upper = lower (α = β = (1 − ηλ)²).
    """
    v = _vec(noise_traces)
    N = v.numel()
    r2 = (1.0 - eta * lam) ** 2
    k = N - 1 - torch.arange(N, dtype=torch.float64, device=v.device)
    return 0.5 * lam * r2**N * dist0_sq + 0.5 * eta**2 * lam * float((r2**k * v).sum())


# ---------------------------------------------------------------- DQSGD rules and their dual

def error_target_k(N: int, L: float, d: int, eta: float, alpha: float, eps_q: float) -> float:
    """docs/algorithms.md §8, convex: k = √(N L d η²/(12 α ε_Q)).

    Minimizing Σ_n(d log2 s_n + B_pre) subject to Σ_n w_n‖g_n‖²/s_n² ≤ ε_Q (with log(s+1) ≈ log s)
    gives s_n = √(N w_n/ε_Q)·‖g_n‖. Every step then adds ε_Q/N, so the real-valued term is exactly
    ε_Q. With the convex weights this is eq. (18)'s shape, s_n = k·α^((N−n)/2)·‖g_n‖_p.
    """
    return math.sqrt(N * L * d * eta**2 / (12.0 * alpha * eps_q))


def error_target_t(L: float, eta: float, d: int, eps_q: float) -> float:
    """docs/algorithms.md §8, non-convex: t = √(L η d/(6(2 − Lη) ε_Q)), giving eq. (20)'s s_n = t‖g_n‖_p."""
    return math.sqrt(L * eta * d / (6.0 * (2.0 - L * eta) * eps_q))


def dqsgd_convex_bits(norms: Floats, k: float, alpha: float) -> torch.Tensor:
    """Eq. (18), real-valued: B_n = log2(k·α^((N−n)/2)·‖g_n‖_p + 1) + 1, n = 0..N−1."""
    g = _vec(norms)
    n = torch.arange(g.numel(), dtype=torch.float64, device=g.device)
    return bits_for_levels(k * alpha ** ((g.numel() - n) / 2.0) * g, torch.log2)


def dqsgd_nonconvex_bits(norms: Floats, t: float) -> torch.Tensor:
    """Eq. (20), real-valued: B_n = log2(t·‖g_n‖_p + 1) + 1."""
    return bits_for_levels(t * _vec(norms), torch.log2)


def _inverse_phi(y: torch.Tensor) -> torch.Tensor:
    """u with φ(u) = 3u − log(1 + e^u) = y. φ is concave with φ' ∈ (2, 3), so Newton converges
    from below after the first step."""
    u = y / 2.0
    for _ in range(60):
        u = u - (3.0 * u - torch.logaddexp(u, torch.zeros_like(u)) - y) / (3.0 - torch.sigmoid(u))
    return u


def optimal_real_bits(norms: Floats, weights: Floats, d: int, C: float,
                      B_pre: float = 32.0) -> torch.Tensor:
    """Real-valued widths B_n minimizing Σ_n w_n‖g_n‖²/s_n² subject to Σ_n (d·B_n + B_pre) = C.

    This is the exact continuous optimum of §4.3/§4.4's problem, with s_n = 2^(B_n−1) − 1 (no
    approximation). Lagrange: d/dB [w g²/s²] = −2 ln2·w g²(s + 1)/s³ is the same for all n, i.e.
    φ(ln s_n) = ln(w_n‖g_n‖²) + θ with φ(u) = 3u − ln(1 + e^u). The "water level" θ is found by
    bisection so that the budget is met. Steps with w_n‖g_n‖² = 0 take the floor B_n = 1 (s = 0).
    In the log domain this says

        B_n − log2‖g_n‖ − ½log2 w_n = const + (3/2)·log2(1 + 1/s_n).

    The paper's two "+1" approximations (s + 1 ≈ s in ds/dB and in B = log2(s+1) + 1) drop the
    last term. The optimum then becomes s_n ∝ √w_n‖g_n‖, which is the shape of eq. (18)/(20). The
    spread of the dropped term is at most (3/2)log2(1 + 1/min s_n).
    """
    g, w = _pair(norms, weights, "norms/weights")
    N = g.numel()
    total = (C - N * B_pre) / d                         # Σ_n B_n
    active = w * g**2 > 0
    n_act = int(active.sum())
    bits = torch.ones(N, dtype=torch.float64, device=g.device)
    budget = total - (N - n_act)                        # what the active steps may spend
    if n_act == 0:
        return torch.full_like(bits, total / N)
    if budget <= n_act:
        raise ValueError(f"C={C} leaves {budget:.4g} bits per coordinate for {n_act} active steps; "
                         f"each needs B_n > 1 (C must exceed N·B_pre + d·N = {N * B_pre + d * N})")
    a = torch.log(w[active] * g[active] ** 2)

    def spend(theta: float) -> tuple[float, torch.Tensor]:
        b = 1.0 + torch.logaddexp(_inverse_phi(a + theta), torch.zeros_like(a)) / math.log(2.0)
        return float(b.sum()), b

    lo, hi = -float(a.max()) - 1.0, -float(a.min()) + 1.0
    while spend(lo)[0] > budget:
        lo -= 2.0 * (hi - lo)
    while spend(hi)[0] < budget:
        hi += 2.0 * (hi - lo)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if spend(mid)[0] < budget else (lo, mid)
    bits[active] = spend(0.5 * (lo + hi))[1]
    return bits


def fixed_vs_dynamic(norms: Floats, weights: Floats, mean_bits: float) -> tuple[float, float]:
    """Appendix E's comparison in general form, under s ≈ 2^(B−1) (i.e. ignoring the "+1").

    With v_n = w_n‖g_n‖² and mean width B̄ = (C − N·B_pre)/(dN), this returns (fixed, dynamic):

        fixed   = Σ_n v_n / 4^(B̄−1)                = N·AM(v)/4^(B̄−1)   (every B_n = B̄)
        dynamic = min_{Σ B_n = N B̄} Σ_n v_n/4^(B_n−1) = N·GM(v)/4^(B̄−1)   (B_n − ½log2 v_n const)

    fixed − dynamic = N(AM − GM)/4^(B̄−1) ≥ 0, with equality iff v_n is constant. That is the λ₁, λ₂
    of eqs. (25)/(28): with B_pre = 32, 4^(B̄−1) = 4^((C−32N−dN)/(dN)), and v_n geometric in n.
    """
    g, w = _pair(norms, weights, "norms/weights")
    v = w * g**2
    scale = 4.0 ** (mean_bits - 1.0)
    gm = float(torch.exp(torch.log(v).mean())) if bool((v > 0).all()) else 0.0
    return float(v.sum()) / scale, v.numel() * gm / scale
