"""The DQSGD paper's theory set beside seeded Monte-Carlo measurements, with plots and a report.

    python -m dqsgd.experiments.theory_checks --out runs/theory [--quick]

writes ``results.json``, four PNG figures and ``report.md`` under ``--out``. Every number comes from
:mod:`dqsgd.theory` (the bounds) and from simulations driven by the real stochastic uniform
quantizer :func:`dqsgd.quantizers.quantize_uniform`. Runs are simulated side by side: one row of an
``(R, d)`` tensor per run, and one quantizer call per step with one norm per row
(``Layout(bucket=d)``). Everything is seeded: a rerun gives the same numbers (timings aside).

1. **Theorem 2** (eq. 17) on a quadratic F(x) = ½(x − x*)ᵀH(x − x*) (H = λI, plus one anisotropic
   diagonal H). The gradient is ∇F(x) + ξ, with Gaussian sampling noise ξ ~ N(0, vI), and it is
   quantized with B bits (p = ∞). The total noise ε_n = Q(g_n) − ∇F(x_n) is a martingale difference
   and is not Gaussian. Its covariance Σ_n = vI + E[diag((r/s)² f_i(1 − f_i))] depends on the state.
   The formula is fed the per-step covariance: the exact conditional quantization variance of every
   run, averaged over runs. (The "Gaussian recursion" with a covariance fixed in advance is *not*
   used.) Theorem 2's identity is exact for such noise, so formula and measurement agree up to MC
   error.
2. **Theorem 1** on ℓ₂-regularised logistic regression. Data: classes 0/1 of
   ``load_dataset("synthetic")``, 64 features plus a bias. L = ‖X‖₂²/(4n) + λ₂ and μ = λ₂. F* comes
   from Newton's method. Minibatches of K are drawn with replacement, quantized with fixed B bits
   (QSGD) or with DQSGD's eq. (18) widths. The bounds get the measured E‖g_n‖_∞², the sampling
   variance and the quantization variance. Three versions are checked. The printed one uses
   σ² = sup and cell factor 1/6 in both bounds. The valid one uses the constants under which the
   proofs' conditions hold (see :func:`theorem1_bounds`). The third is the valid one, restarted at
   the step n₀ ≤ N/2 that gives the tightest bound.
3. **Proposition 1**: the variance of the real quantizer, measured by MC, divided by d‖g‖²/(6s²),
   for B = 2..10. It is taken on logistic gradients from item 2, on vectors that meet the
   proposition's assumption, and on mid-cell (worst-case) vectors.
4. **DQSGD vs fixed bits at equal total bits**: the bound's quantization term
   Σ w_n E‖g_n‖²/s_n² and the measured final error, for DQSGD (k set so that its mean width is as
   close to the fixed width as it gets without exceeding it) and for fixed widths, with :func:`dqsgd.theory.optimal_real_bits` for reference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

import dqsgd.theory as T
from dqsgd.quantizers import Layout, Norm, dequantize, quantize_uniform

F64 = torch.float64
INF = math.inf
MIN_BITS, MAX_BITS = 2, 16   # the uniform quantizer's range
B_PRE = 32.0                 # bits of a message beyond d·B (one float32 norm), as in Appendix E
PLOTTED_T1 = ("fixed-3", "dqsgd-3")  # configurations whose bounds are drawn vs N


# ---------------------------------------------------------------- settings

@dataclass(frozen=True)
class Settings:
    """What is simulated. ``QUICK`` and ``FULL`` differ only in the number of runs and budgets."""

    seed: int = 0
    # Theorem 2: quadratic, H = λI (and one anisotropic diagonal H at the headline width)
    q_dim: int = 20
    q_lam: float = 1.0
    q_eta: float = 0.05
    q_noise: float = 0.1            # per-coordinate variance v of the Gaussian sampling noise
    q_steps: int = 200
    q_runs: int = 20_000
    q_bits: tuple[int, ...] = (2, 3, 4, 8)
    q_headline_bits: int = 3
    q_aniso: tuple[float, float] = (0.2, 1.0)  # eigenvalue range of the anisotropic H
    # Theorem 1 / item 4: logistic regression
    lr_lam2: float = 0.2
    lr_batch: int = 16
    lr_steps: int = 200
    lr_runs: int = 2_000
    lr_eta_factor: float = 0.5      # η = factor / L (β ≥ 0 needs η ≤ (1 − √(1 − μ/L))/μ ≈ 1/(2L))
    fixed_bits: tuple[int, ...] = (2, 3, 4, 6)
    budgets: tuple[int, ...] = (3, 4, 6)
    dqsgd_iters: int = 2            # closed-loop simulations of DQSGD per budget (at least)
    # Proposition 1
    p1_bits: tuple[int, ...] = tuple(range(2, 11))
    p1_vectors: int = 64
    p1_draws: int = 1_000


FULL = Settings()
QUICK = replace(FULL, q_runs=2_000, lr_runs=200, lr_steps=120, fixed_bits=(2, 3, 4), budgets=(3, 4),
                p1_vectors=16, p1_draws=400)


def _command(out: Path, quick: bool) -> str:
    return f"python -m dqsgd.experiments.theory_checks --out {out}" + (" --quick" if quick else "")


# ---------------------------------------------------------------- the quantizer, row-wise

def levels(bits: torch.Tensor | int) -> torch.Tensor:
    """s = 2^(B−1) − 1 as float64 (elementwise)."""
    return 2.0 ** (torch.as_tensor(bits, dtype=F64) - 1.0) - 1.0


def quantize_rows(G: torch.Tensor, bits: torch.Tensor | int, gen: torch.Generator,
                  norm: Norm = Norm.MAX) -> torch.Tensor:
    """Q(g) for every row of G (R, d) with :func:`quantize_uniform`, one norm per row.

    ``bits`` is one int or one per row. Rows with the same width are quantized in one call.
    Returns float64 values; the quantizer itself works in float32.
    """
    R, d = G.shape
    if isinstance(bits, int):
        q = quantize_uniform(G.reshape(-1), bits, gen, norm=norm, layout=Layout(bucket=d))
        return dequantize(q).reshape(R, d).to(F64)
    out = torch.empty_like(G)
    for b in torch.unique(bits).tolist():
        idx = (bits == b).nonzero().squeeze(1)
        q = quantize_uniform(G[idx].reshape(-1), int(b), gen, norm=norm, layout=Layout(bucket=d))
        out[idx] = dequantize(q).reshape(idx.numel(), d).to(F64)
    return out


def row_norms(G: torch.Tensor, p: float) -> torch.Tensor:
    return G.abs().amax(1) if math.isinf(p) else torch.linalg.vector_norm(G, ord=p, dim=1)


def cell_variance(G: torch.Tensor, s: torch.Tensor | float, p: float = INF) -> torch.Tensor:
    """Per-coordinate Var[Q(g)_i | g] = (r/s)² f_i(1 − f_i) for every row (R, d), in float64.

    This is :func:`dqsgd.theory.exact_quantization_variance` row-wise, before the sum over i.
    """
    r = row_norms(G, p).unsqueeze(1)
    s = torch.as_tensor(s, dtype=F64)
    s = s.reshape(-1, 1) if s.dim() else s
    y = s * G.abs() / torch.where(r > 0, r, torch.ones_like(r))
    f = y - torch.floor(y)
    return torch.where(r > 0, (r / s) ** 2 * f * (1.0 - f), torch.zeros_like(G))


# ---------------------------------------------------------------- 1. Theorem 2

def _simulate_quadratic(S: Settings, h: torch.Tensor, bits: int, seed: int, grid: list[int]) -> dict[str, Any]:
    """R runs of x_{n+1} = x_n − η Q(∇F(x_n) + ξ_n) on F = ½ eᵀ diag(h) e, e = x − x*.

    Returns, at every N in ``grid``: the measured mean of F(x_N) − F* and its SE. It also returns
    the per-step covariances averaged over runs (for the formula), and the per-run paired difference
    F(x_N) − F* minus that run's own formula value. Each run's formula uses its own conditional
    variances; its mean over runs is exactly E[F(x_N) − F*].
    """
    d, R, N, eta, v = S.q_dim, S.q_runs, max(grid), S.q_eta, S.q_noise
    g_data = torch.Generator().manual_seed(seed)
    g_q = torch.Generator().manual_seed(seed + 1)
    e0 = torch.randn(d, generator=torch.Generator().manual_seed(S.seed + 7), dtype=F64)  # x0 − x*
    e = e0.expand(R, d).clone()
    s = float(levels(bits))
    r2 = (1.0 - eta * h) ** 2                          # per-eigendirection contraction of E[e_j²]
    acc = torch.zeros(R, d, dtype=F64)                # Σ_n r2^(N−1−n) (v + qvar_{n,j}) per run
    qdiag = torch.zeros(N, d, dtype=F64)              # E_runs qvar_{n,j}
    g_inf2 = torch.zeros(N, dtype=F64)                # E_runs ‖g_n‖_∞² (for Prop. 1's approximation)
    out: dict[int, dict[str, float]] = {}

    def record(n: int) -> None:
        err = 0.5 * (h * e * e).sum(1)
        init = 0.5 * float((h * r2**n * e0**2).sum())
        paired = err - (init + 0.5 * eta**2 * (h * acc).sum(1))
        out[n] = {"measured": float(err.mean()), "se": float(err.std() / math.sqrt(R)),
                  "paired_diff": float(paired.mean()), "paired_se": float(paired.std() / math.sqrt(R))}

    for n in range(N):
        if n in grid:
            record(n)
        g = h * e + math.sqrt(v) * torch.randn(R, d, generator=g_data, dtype=F64)
        var = cell_variance(g, s)
        qdiag[n] = var.mean(0)
        g_inf2[n] = (g.abs().amax(1) ** 2).mean()
        acc = r2 * acc + v + var
        e = e - eta * quantize_rows(g, bits, g_q)
    record(N)
    return {"points": out, "qdiag": qdiag, "g_inf2": g_inf2, "e0": e0}


def theorem2_check(S: Settings) -> dict[str, Any]:
    d, lam, eta, v, N = S.q_dim, S.q_lam, S.q_eta, S.q_noise, S.q_steps
    grid = sorted({0, *range(0, N + 1, max(1, N // 20)), N})
    h_iso = torch.full((d,), lam, dtype=F64)
    rows = []
    for i, bits in enumerate(S.q_bits):
        sim = _simulate_quadratic(S, h_iso, bits, S.seed + 100 + 10 * i, grid)
        traces = d * v + sim["qdiag"].sum(1)          # Tr Σ_n = d·v + E Σ_i (r/s)² f_i(1 − f_i)
        dist0 = float((sim["e0"] ** 2).sum())
        s = float(levels(bits))
        prop1_traces = d * v + d * sim["g_inf2"] / (6 * s**2)
        curve = []
        for n in grid:
            pt = sim["points"][n]
            formula = T.theorem2_isotropic(dist0, lam, eta, traces[:n])
            curve.append({"N": n, "formula": formula,
                          "formula_prop1": T.theorem2_isotropic(dist0, lam, eta, prop1_traces[:n]), **pt,
                          "z": (pt["measured"] - formula) / pt["se"] if pt["se"] > 0 else 0.0})
        rows.append({"bits": bits, "H": "isotropic", "curve": curve, "final": curve[-1]})
    # One anisotropic check with the general formula (eq. 17), at the headline width.
    lo, hi = S.q_aniso
    h = lam * torch.linspace(lo, hi, d, dtype=F64)
    bits = S.q_headline_bits
    sim = _simulate_quadratic(S, h, bits, S.seed + 999, [N])
    covs = torch.diag_embed(v + sim["qdiag"])
    formula = T.theorem2_expected_error(sim["e0"], torch.diag(h), eta, covs)
    pt = sim["points"][N]
    aniso = {"bits": bits, "H": f"diag(linspace({lo}·λ, {hi}·λ))", "N": N, "formula": formula, **pt,
             "z": (pt["measured"] - formula) / pt["se"]}
    head = next(r for r in rows if r["bits"] == S.q_headline_bits)["final"]
    return {"setting": {"d": d, "lambda": lam, "eta": eta, "sampling_var_per_coord": v, "N": N,
                        "runs": S.q_runs, "bits": list(S.q_bits), "norm": "max (p = inf)",
                        "x0_minus_xstar": "N(0, I_d), seeded"},
            "isotropic": rows, "anisotropic": aniso,
            "headline": {"bits": S.q_headline_bits, "N": N, **head},
            "max_abs_z": max(abs(r["final"]["z"]) for r in rows + [{"final": aniso}])}


# ---------------------------------------------------------------- 2. the logistic problem

@dataclass
class Logistic:
    """F(x) = (1/n) Σ_i log(1 + exp(−y_i a_iᵀx)) + (λ₂/2)‖x‖², y_i = ±1."""

    X: torch.Tensor
    Y: torch.Tensor
    lam2: float
    L: float = 0.0
    mu: float = 0.0
    xstar: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    Fstar: float = 0.0
    newton_grad_norm: float = 0.0

    @property
    def n(self) -> int:
        return self.X.shape[0]

    @property
    def d(self) -> int:
        return self.X.shape[1]

    def value(self, x: torch.Tensor) -> torch.Tensor:
        m = (x @ self.X.T) * self.Y
        return torch.nn.functional.softplus(-m).mean(-1) + 0.5 * self.lam2 * (x * x).sum(-1)

    def coefs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-sample gradient coefficients c with ∇l_i = c_i a_i, margins)."""
        m = (x @ self.X.T) * self.Y
        return -self.Y * torch.sigmoid(-m), m


def make_logistic(lam2: float) -> Logistic:
    """Classes 0 and 1 of the seeded synthetic set (64 features) plus a bias column; F* by Newton."""
    from dqsgd.data import load_dataset

    ds = load_dataset("synthetic", seed=0)
    x, y = ds.train.x.flatten(1).to(F64), ds.train.y
    keep = (y == 0) | (y == 1)
    X = torch.cat([x[keep], torch.ones(int(keep.sum()), 1, dtype=F64)], 1)
    Y = 2.0 * (y[keep] == 1).to(F64) - 1.0
    P = Logistic(X, Y, lam2)
    P.L = float(torch.linalg.matrix_norm(X, 2)) ** 2 / (4 * P.n) + lam2
    P.mu = lam2
    w = torch.zeros(P.d, dtype=F64)
    for _ in range(100):                               # damped Newton, to machine precision
        c, m = P.coefs(w)
        grad = X.T @ c / P.n + lam2 * w
        if float(grad.norm()) < 1e-14:
            break
        sig = torch.sigmoid(m)
        Hs = (X.T * (sig * (1 - sig))) @ X / P.n + lam2 * torch.eye(P.d, dtype=F64)
        step, t, f0 = torch.linalg.solve(Hs, grad), 1.0, float(P.value(w))
        while float(P.value(w - t * step)) > f0 and t > 1e-8:
            t /= 2
        w = w - t * step
    c, _ = P.coefs(w)
    P.xstar, P.Fstar = w, float(P.value(w))
    P.newton_grad_norm = float((X.T @ c / P.n + lam2 * w).norm())
    return P


Widths = Callable[[int, torch.Tensor], torch.Tensor]   # (step n, ‖g_n‖_∞ per run) -> int widths per run


def simulate_logistic(P: Logistic, eta: float, K: int, N: int, R: int, widths: Widths, seed: int,
                      keep_grads_at: tuple[int, ...] = (), keep_per_step: int = 0) -> dict[str, torch.Tensor]:
    """R runs of x_{n+1} = x_n − η Q_{B_n}(g_n) from x_0 = 0, g_n a K-minibatch gradient (with
    replacement). Per-step means over runs of what the bounds need. Minibatch indices come from
    their own generator, so every width rule sees the same minibatch draws (common random numbers).
    """
    g_data = torch.Generator().manual_seed(seed)
    g_q = torch.Generator().manual_seed(seed + 1)
    x = torch.zeros(R, P.d, dtype=F64)
    Xn2 = (P.X**2).sum(1)
    keys = ("err", "g2", "g2_s2", "qvar", "sigma2", "bits", "gradF2")
    m = {k: torch.zeros(N + (k == "err"), dtype=F64) for k in keys}
    norms = torch.zeros(N, R, dtype=F64)
    bits_runs = torch.zeros(N, R, dtype=F64)
    kept = []
    for n in range(N):
        c, margin = P.coefs(x)
        m["err"][n] = (torch.nn.functional.softplus(-margin).mean(1) + 0.5 * P.lam2 * (x * x).sum(1)).mean() - P.Fstar
        mean_grad = c @ P.X / P.n
        m["sigma2"][n] = ((c * c * Xn2).mean(1) - (mean_grad**2).sum(1)).mean()  # E_runs σ²(x_n)
        m["gradF2"][n] = ((mean_grad + P.lam2 * x) ** 2).sum(1).mean()
        idx = torch.randint(P.n, (R, K), generator=g_data)
        g = (c.gather(1, idx).unsqueeze(2) * P.X[idx]).mean(1) + P.lam2 * x
        r = g.abs().amax(1)
        b = widths(n, r)
        s = levels(b)
        norms[n], bits_runs[n] = r, b.to(F64)
        m["g2"][n] = (r**2).mean()
        m["g2_s2"][n] = (r**2 / s**2).mean()
        m["qvar"][n] = cell_variance(g, s).sum(1).mean()
        m["bits"][n] = b.to(F64).mean()
        if n in keep_grads_at:
            kept.append(g[:keep_per_step].clone())
        x = x - eta * quantize_rows(g, b, g_q)
    final = P.value(x) - P.Fstar
    m["err"][N] = final.mean()
    return {**m, "final": final, "norms": norms, "bits_runs": bits_runs,
            "kept": torch.cat(kept) if kept else torch.zeros(0, P.d, dtype=F64)}


def fixed_widths(bits: int) -> Widths:
    return lambda n, r: torch.full(r.shape, bits, dtype=torch.int64)


def dqsgd_real_widths(k: float, alpha: float, N: int, n: int | torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Eq. (18): B_n = log2(k·α^((N−n)/2)·‖g_n‖_∞ + 1) + 1 (real), as :meth:`DQSGDRule.real_width`."""
    return torch.log2(k * alpha ** ((N - torch.as_tensor(n, dtype=F64)) / 2.0) * r + 1.0) + 1.0


def dqsgd_widths(k: float, alpha: float, N: int) -> Widths:
    """Eq. (18) rounded to the nearest integer and clipped to [2, 16] (DQSGDRule's NEAREST rounding).

    Each run uses its own current gradient norm (Algorithm 1, one node). Algorithm 2's one-step lag
    is what :class:`dqsgd.policies.DQSGDRule` does in distributed training.
    """
    def widths(n: int, r: torch.Tensor) -> torch.Tensor:
        real = dqsgd_real_widths(k, alpha, N, n, r)
        return torch.floor(real + 0.5).clamp(MIN_BITS, MAX_BITS).to(torch.int64)
    return widths


def solve_k(norms: torch.Tensor, alpha: float, mean_bits: float) -> float:
    """The largest k whose integer eq.-(18) widths on ``norms`` (N, R) average at most ``mean_bits``."""
    N = norms.shape[0]
    n = torch.arange(N, dtype=F64).unsqueeze(1)

    def spend(logk: float) -> float:
        real = dqsgd_real_widths(math.exp(logk), alpha, N, n, norms)
        return float(torch.floor(real + 0.5).clamp(MIN_BITS, MAX_BITS).mean())

    lo, hi = -80.0, 80.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if spend(mid) <= mean_bits else (lo, mid)
    return math.exp(lo)


def run_dqsgd(P: Logistic, eta: float, K: int, N: int, R: int, alpha: float, mean_bits: float,
              pilot_norms: torch.Tensor, iters: int, seed: int) -> tuple[dict[str, torch.Tensor], float, list[dict]]:
    """Closed-loop DQSGD whose realized mean width (over runs and steps) is at most ``mean_bits``.

    k is solved on the norms of the previous simulation (the first time, on the fixed-width run's
    norms), and the simulation is run again with the new k. The run kept is the one with the
    largest mean width that does not overspend. An overspend lowers the next solve's target by
    the excess. At least ``iters`` simulations are run, and at most ``iters + 4``.
    """
    norms, goal, best, history = pilot_norms, mean_bits, None, []
    for it in range(iters + 4):
        k = solve_k(norms, alpha, goal)
        sim = simulate_logistic(P, eta, K, N, R, dqsgd_widths(k, alpha, N), seed)
        spent = float(sim["bits"].mean())
        history.append({"k": k, "target": goal, "mean_bits": spent})
        if spent <= mean_bits + 1e-12:
            if best is None or spent > best[2]:
                best = (sim, k, spent)
        else:
            goal -= spent - mean_bits + 1e-4
        norms = sim["norms"]
        if best is not None and it + 1 >= iters:
            break
    if best is None:
        raise RuntimeError(f"DQSGD overspent {mean_bits} bits in every try: {history}")
    return best[0], best[1], history


def _effective(sim: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step (norms, bits) for the theory functions: norms = √E‖g_n‖², and bits such that
    ‖g‖²/s² gives E[‖g_n‖²/s_n²]. The widths may differ between runs (DQSGD)."""
    norms = sim["g2"].sqrt()
    s_eff = (sim["g2"] / sim["g2_s2"]).sqrt()
    return norms, torch.log2(s_eff + 1.0) + 1.0


def _bound_inputs(P: Logistic, sim: dict[str, torch.Tensor], start: int, N: int) -> dict[str, Any]:
    norms, bits = _effective(sim)
    sig = sim["sigma2"][start:N]
    ratio = sim["qvar"][start:N] / (P.d * sim["g2_s2"][start:N])
    return {"gap": float(sim["err"][start]), "norms": norms[start:N], "bits": bits[start:N],
            "s_up": float(sig.max()), "s_lo": float(sig.min()), "c_up": float(ratio.max()), "c_lo": float(ratio.min())}


def theorem1_bounds(P: Logistic, eta: float, K: int, sim: dict[str, torch.Tensor], N: int | None = None,
                    start: int = 0) -> dict[str, Any]:
    """Theorem 1's bounds on E[F(x_N) − F*] (default N: the whole run) in three versions.

    * ``printed``: σ² = sup_n E σ²(x_n) in both bounds (Assumption 3 as a bound), cell factor 1/6 in
      both. Upper valid iff E qvar_n ≤ (1/6)·d·E[‖g‖²/s²] at every step. Lower valid only if the
      sampling and quantization variances are at least σ²/K and (1/6)·d‖g‖²/s² at every step.
    * ``valid``: constants under which each proof's inequalities hold at every step: upper with
      σ²_up = sup_n E σ²(x_n) and c_up = max_n ratio_n, lower with σ²_lo = inf_n E σ²(x_n) and
      c_lo = min_n ratio_n, where ratio_n = E qvar_n / (d·E[‖g_n‖²/s_n²]) (measured, exact
      conditional variances). With β ≥ 0 (checked) and η ≤ 2/L, lower ≤ E[F(x_N) − F*] ≤ upper.
    * ``worst_case``: the upper bound with cell factor 1/4, valid for every g without measuring.

    ``start`` = n₀ applies the theorem to the chain from step n₀ on. The proof's one-step
    inequality holds at every step, so unrolling it from n₀ is the same theorem with
    F(x_0) − F* := E[F(x_{n₀}) − F*] (measured), N − n₀ steps, and sup/inf over n ≥ n₀ only.
    """
    N = sim["g2"].numel() if N is None else N
    I = _bound_inputs(P, sim, start, N)
    args = (I["gap"], P.L, P.mu, eta)

    def up(sigma2: float, c: float) -> T.BoundTerms:
        return T.theorem1_upper_terms(*args, sigma2, K, P.d, I["norms"], I["bits"], cell_factor=c)

    def low(sigma2: float, c: float) -> T.BoundTerms:
        return T.theorem1_lower_terms(*args, sigma2, K, P.d, I["norms"], I["bits"], cell_factor=c)

    def terms(t: T.BoundTerms) -> dict[str, float]:
        return {"total": t.total, "optimization": t.optimization, "sampling": t.sampling, "quantization": t.quantization}

    return {
        "start": start,
        "printed": {"upper": terms(up(I["s_up"], 1 / 6)), "lower": terms(low(I["s_up"], 1 / 6)),
                    "upper_conditions_hold": I["c_up"] <= 1 / 6,
                    "lower_conditions_hold": I["c_lo"] >= 1 / 6 and I["s_lo"] >= I["s_up"]},
        "valid": {"upper": terms(up(I["s_up"], I["c_up"])), "lower": terms(low(I["s_lo"], I["c_lo"])),
                  "upper_conditions_hold": True, "lower_conditions_hold": True},
        "worst_case": {"upper": terms(up(I["s_up"], 0.25))},
        "constants": {"sigma2_sup": I["s_up"], "sigma2_inf": I["s_lo"], "cell_factor_max": I["c_up"],
                      "cell_factor_min": I["c_lo"], "F0_gap": I["gap"]},
    }


def valid_totals(P: Logistic, eta: float, K: int, sim: dict[str, torch.Tensor], N: int, start: int) -> tuple[float, float]:
    """(upper, lower) of the ``valid`` version of :func:`theorem1_bounds`, without the rest."""
    I = _bound_inputs(P, sim, start, N)
    args = (I["gap"], P.L, P.mu, eta)
    return (T.theorem1_upper(*args, I["s_up"], K, P.d, I["norms"], I["bits"], cell_factor=I["c_up"]),
            T.theorem1_lower(*args, I["s_lo"], K, P.d, I["norms"], I["bits"], cell_factor=I["c_lo"]))


def best_restart(P: Logistic, eta: float, K: int, sim: dict[str, torch.Tensor], N: int,
                 starts: list[int]) -> tuple[float, int, float, int]:
    """The tightest valid bounds over restart points n₀ < N: (upper, its n₀, lower, its n₀).
    Each is a valid bound, so the min of the uppers and the max of the lowers are too."""
    vals = [(n0, *valid_totals(P, eta, K, sim, N, n0)) for n0 in starts if n0 < N]
    u = min(vals, key=lambda v: v[1])
    lo = max(vals, key=lambda v: v[2])
    return u[1], u[0], lo[2], lo[0]


def theorem1_check(S: Settings) -> dict[str, Any]:
    P = make_logistic(S.lr_lam2)
    eta = S.lr_eta_factor / P.L
    K, N, R = S.lr_batch, S.lr_steps, S.lr_runs
    alpha, beta = T.theorem1_alpha_beta(P.L, P.mu, eta)
    beta_max_eta = (1 - math.sqrt(1 - P.mu / P.L)) / P.mu
    seed = S.seed + 2000
    sims: dict[str, dict[str, torch.Tensor]] = {}
    configs: list[dict[str, Any]] = []
    keep = (0, N // 4, N // 2, N - 1)
    for i, b in enumerate(S.fixed_bits):
        sims[f"fixed-{b}"] = simulate_logistic(P, eta, K, N, R, fixed_widths(b), seed, keep_grads_at=keep if i == 0 else (),
                                               keep_per_step=-(-S.p1_vectors // len(keep)))
        configs.append({"name": f"fixed-{b}", "kind": "fixed", "target_bits": b, "k": None})
    for b in S.budgets:
        pilot = sims[f"fixed-{b}"]["norms"] if f"fixed-{b}" in sims else simulate_logistic(
            P, eta, K, N, R, fixed_widths(b), seed)["norms"]
        sim, k, hist = run_dqsgd(P, eta, K, N, R, alpha, b, pilot, S.dqsgd_iters, seed)
        sims[f"dqsgd-{b}"] = sim
        configs.append({"name": f"dqsgd-{b}", "kind": "dqsgd", "target_bits": b, "k": k, "k_history": hist})
    starts = list(range(0, N // 2 + 1, max(1, N // 40)))    # restarts n₀ ≤ N/2 (see theorem1_bounds)
    for c in configs:
        sim = sims[c["name"]]
        final = sim["final"]
        c["mean_bits"] = float(sim["bits"].mean())
        c["measured"] = float(final.mean())
        c["se"] = float(final.std() / math.sqrt(R))
        c["bounds"] = theorem1_bounds(P, eta, K, sim)
        _, n_up, _, n_lo = best_restart(P, eta, K, sim, N, starts)
        c["bounds"]["restart"] = {"upper": theorem1_bounds(P, eta, K, sim, start=n_up)["valid"]["upper"],
                                  "lower": theorem1_bounds(P, eta, K, sim, start=n_lo)["valid"]["lower"],
                                  "upper_start": n_up, "lower_start": n_lo,
                                  "upper_conditions_hold": True, "lower_conditions_hold": True}
        for which in ("printed", "valid", "restart"):
            B = c["bounds"][which]
            lo, hi = B["lower"]["total"], B["upper"]["total"]
            B["inside"] = lo <= c["measured"] <= hi
            B["inside_3se"] = lo - 3 * c["se"] <= c["measured"] <= hi + 3 * c["se"]
            B["upper_over_measured"] = hi / c["measured"]
            B["measured_over_lower"] = c["measured"] / lo
        c["bits_profile"] = sim["bits"][:: max(1, N // 50)].tolist()
        c["err_curve"] = sim["err"].tolist()
    # bounds vs horizon N (prefixes of the same runs), for the plot
    ns = list(range(N // 20, N + 1, max(1, N // 20)))
    coarse = list(range(0, N // 2 + 1, max(1, N // 20)))
    for c in configs:
        if c["name"] not in PLOTTED_T1:
            continue
        sim = sims[c["name"]]
        x0 = [valid_totals(P, eta, K, sim, n, 0) for n in ns]
        rs = [best_restart(P, eta, K, sim, n, [n0 for n0 in coarse if n0 <= n // 2]) for n in ns]
        c["bounds_vs_N"] = {"N": ns, "upper": [u for u, _ in x0], "lower": [lo for _, lo in x0],
                            "restart_upper": [r[0] for r in rs], "restart_lower": [r[2] for r in rs]}
    inside = {w: [sum(c["bounds"][w]["inside"] for c in configs), len(configs)]
              for w in ("valid", "restart", "printed")}
    problem = {"data": "classes 0/1 of load_dataset('synthetic'), 64 features + bias", "n": P.n, "d": P.d,
               "lambda2": P.lam2, "L": P.L, "L_formula": "||X||_2^2/(4n) + lambda2", "mu": P.mu,
               "mu_formula": "lambda2", "F_star": P.Fstar, "newton_grad_norm": P.newton_grad_norm,
               "eta": eta, "eta_over_1_over_L": S.lr_eta_factor, "K": K, "N": N, "runs": R,
               "alpha": alpha, "beta": beta, "beta_nonneg_needs_eta_le": beta_max_eta,
               "eta_le_2_over_L": eta <= 2 / P.L, "beta_nonneg": beta >= 0, "norm": "max (p = inf)",
               "sampling": f"K = {K} samples with replacement"}
    return {"problem": problem, "configs": configs, "inside": inside, "_sims": sims, "_P": P}


# ---------------------------------------------------------------- 4. DQSGD vs fixed at equal bits

def equal_bits_check(S: Settings, t1: dict[str, Any]) -> dict[str, Any]:
    P, sims, pr = t1["_P"], t1["_sims"], t1["problem"]
    eta, N, alpha = pr["eta"], pr["N"], pr["alpha"]
    w = T.convex_weights(N, P.L, P.d, eta, alpha)    # the upper bound's weights; cell factor 1/6
    by_name = {c["name"]: c for c in t1["configs"]}
    rows = []
    for b in S.budgets:
        fx, dq = sims[f"fixed-{b}"], sims[f"dqsgd-{b}"]
        nf, bf = _effective(fx)
        nd, bd = _effective(dq)
        q_fixed = T.quantization_term(nf, bf, w)
        q_dqsgd = T.quantization_term(nd, bd, w)
        C = N * (P.d * b + B_PRE)
        real = T.optimal_real_bits(nf, w, P.d, C, B_pre=B_PRE)
        q_real = T.quantization_term(nf, real, w)
        am, gm = T.fixed_vs_dynamic(nf, w, float(b))
        cf, cd = by_name[f"fixed-{b}"], by_name[f"dqsgd-{b}"]
        diff = dq["final"] - fx["final"]   # same minibatch draws (common random numbers): paired
        rows.append({"budget_bits": b, "dqsgd_mean_bits": cd["mean_bits"], "fixed_mean_bits": cf["mean_bits"],
                     "quant_term_fixed": q_fixed, "quant_term_dqsgd": q_dqsgd,
                     "quant_term_real_optimum": q_real, "real_optimum_min_bits": float(real.min()),
                     "real_optimum_max_bits": float(real.max()),
                     "appendix_e_fixed_AM": am, "appendix_e_dynamic_GM": gm,
                     "bound_ratio_dqsgd_over_fixed": q_dqsgd / q_fixed,
                     "measured_fixed": cf["measured"], "se_fixed": cf["se"],
                     "measured_dqsgd": cd["measured"], "se_dqsgd": cd["se"],
                     "measured_ratio_dqsgd_over_fixed": cd["measured"] / cf["measured"],
                     "paired_diff": float(diff.mean()), "paired_diff_se": float(diff.std() / math.sqrt(diff.numel())),
                     "upper_fixed": cf["bounds"]["valid"]["upper"]["total"],
                     "upper_dqsgd": cd["bounds"]["valid"]["upper"]["total"],
                     "real_optimum_bits": real.tolist(), "dqsgd_bits_profile": dq["bits"].tolist()})
    return {"weights": "upper-bound weights (L d eta^2/12) alpha^(N-1-n), cell factor 1/6", "rows": rows}


# ---------------------------------------------------------------- 3. Proposition 1

def _mc_variance(V: torch.Tensor, bits: int, draws: int, gen: torch.Generator, norm: Norm) -> torch.Tensor:
    """E‖Q(g) − g‖² per row of V, by ``draws`` quantizations each (the real quantizer)."""
    rep = V.to(torch.float32).to(F64).repeat_interleave(draws, 0)
    q = quantize_rows(rep, bits, gen, norm)
    return ((q - rep) ** 2).sum(1).view(V.shape[0], draws).mean(1)


def proposition1_check(S: Settings, grads: torch.Tensor) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(S.seed + 3000)
    gv = torch.Generator().manual_seed(S.seed + 3001)
    V, d = grads.shape[0], grads.shape[1]
    series: dict[str, list[dict[str, float]]] = {"logistic p=inf": [], "logistic p=2": [],
                                                  "assumption p=inf": [], "mid-cell p=inf": []}
    max_rel_mc_vs_exact = 0.0
    for b in S.p1_bits:
        s = int(levels(b))
        # vectors meeting the assumption (p = ∞): g_0 = ±1 is the max; |g_i| ~ U(0, 1) has uniform
        # fractional parts of s|g_i| for every integer s. Mid-cell: |g_i| = (l_i + ½)/s, f_i = ½.
        sign = torch.where(torch.rand(V, d, generator=gv) < 0.5, -1.0, 1.0).to(F64)
        uni = torch.rand(V, d, generator=gv, dtype=F64)
        uni[:, 0] = 1.0
        mid = (torch.randint(0, s, (V, d), generator=gv).to(F64) + 0.5) / s
        mid[:, 0] = 1.0
        sets = {"logistic p=inf": (grads, Norm.MAX, INF), "logistic p=2": (grads, Norm.L2, 2.0),
                "assumption p=inf": (sign * uni, Norm.MAX, INF), "mid-cell p=inf": (sign * mid, Norm.MAX, INF)}
        for name, (G, nm, p) in sets.items():
            G32 = G.to(torch.float32).to(F64)
            meas = _mc_variance(G32, b, S.p1_draws, gen, nm)
            exact = torch.tensor([T.exact_quantization_variance(g, s, p) for g in G32], dtype=F64)
            r2 = row_norms(G32, p) ** 2
            pred = d * r2 / (6 * s**2)
            ratio = meas / pred
            ok = exact > 0
            rel = float(((meas - exact).abs()[ok] / exact[ok]).max()) if bool(ok.any()) else 0.0
            max_rel_mc_vs_exact = max(max_rel_mc_vs_exact, rel)
            series[name].append({"bits": b, "s": s, "ratio_mean": float(ratio.mean()),
                                 "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max()),
                                 "exact_ratio_mean": float((exact / pred).mean()),
                                 "max_over_worst_case": float((meas / (d * r2 / (4 * s**2))).max())})
    return {"d": d, "vectors_per_set": V, "draws_per_vector": S.p1_draws, "bits": list(S.p1_bits),
            "series": series, "max_rel_diff_mc_vs_exact": max_rel_mc_vs_exact,
            "assumption_expected_ratio": (d - 1) / d, "worst_case_ratio": 1.5}


# ---------------------------------------------------------------- plots

def _fig(w: float, h: float):
    from dqsgd._extras import require

    return require("matplotlib.figure", "the theory checks' figures").Figure(figsize=(w, h), layout="constrained")


def _caption(fig, text: str) -> None:
    fig.supxlabel(text, fontsize=7, color="0.35")


def plot_theorem2(res: dict[str, Any], path: Path, cmd: str) -> None:
    fig = _fig(7.5, 6.8)
    ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=[2.2, 1])
    for i, row in enumerate(res["isotropic"]):
        col = f"C{i}"
        N = [p["N"] for p in row["curve"]]
        ax.plot(N, [p["formula"] for p in row["curve"]], color=col, lw=1.5, label=f"B = {row['bits']}: Theorem 2")
        ax.errorbar(N, [p["measured"] for p in row["curve"]], yerr=[p["se"] for p in row["curve"]], fmt="o",
                    ms=3.5, color=col, mfc="none", capsize=2, label=f"B = {row['bits']}: MC mean ± SE")
        pts = [p for p in row["curve"] if p["N"] > 0]
        ax2.errorbar([p["N"] + (i - 1.5) * 0.8 for p in pts], [p["measured"] / p["formula"] - 1 for p in pts],
                     yerr=[p["se"] / p["formula"] for p in pts], fmt="o", ms=3, color=col, capsize=2)
    ax.set_yscale("log")
    ax.set_ylabel("E[F(x_N) − F*]")
    st = res["setting"]
    ax.set_title(f"Theorem 2, quadratic H = λI, d = {st['d']}, η = {st['eta']}, real quantizer (p = ∞) "
                 f"+ N(0, {st['sampling_var_per_coord']}·I) sampling noise, {st['runs']} runs", fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    ax2.axhline(0.0, color="k", lw=1)
    ax2.set_xlabel("N (steps)")
    ax2.set_ylabel("measured / formula − 1 (± SE)", fontsize=8)
    _caption(fig, f"made by: {cmd}")
    fig.savefig(path, dpi=110, metadata={"Software": None})


def plot_theorem1(res: dict[str, Any], path: Path, cmd: str) -> None:
    fig = _fig(13.0, 5.2)
    ax, ax2 = fig.subplots(1, 2)
    pr = res["problem"]
    series = [("valid", "upper", "C0", "-", "upper, from x₀"),
              ("restart", "upper", "C1", "-", "upper, tightest restart n₀"),
              ("restart", "lower", "C2", "--", "lower, tightest restart n₀"),
              ("valid", "lower", "C3", "--", "lower, from x₀"),
              ("printed", "upper", "0.5", ":", "upper as printed (σ² = sup, 1/6)")]
    for kind, mk in (("fixed", "o"), ("dqsgd", "s")):
        cs = [c for c in res["configs"] if c["kind"] == kind]
        if not cs:
            continue
        x = [c["mean_bits"] for c in cs]
        name = "fixed B (QSGD)" if kind == "fixed" else "DQSGD eq. 18, equal mean bits"
        ax.errorbar(x, [c["measured"] for c in cs], yerr=[c["se"] for c in cs], fmt=mk, color="k", capsize=3,
                    ms=6, mfc="k" if kind == "fixed" else "none", label=f"measured ± SE: {name}", zorder=5)
        for which, side, col, ls, lab in series:
            y = [c["bounds"][which][side]["total"] for c in cs]
            if kind == "fixed":
                ax.plot(x, y, mk + ls, color=col, ms=4, lw=1.2, label=lab)
            else:
                ax.plot(x, y, mk, color=col, ms=7, mfc="none")
    ax.set_yscale("log")
    ax.set_xlabel("mean bits per coordinate (circles: fixed B, squares: DQSGD)")
    ax.set_ylabel(f"E[F(x_N) − F*], N = {pr['N']}")
    ax.set_title(f"Theorem 1, logistic regression: n = {pr['n']}, d = {pr['d']}, L = {pr['L']:.3g}, "
                 f"μ = {pr['mu']:.3g}, η = {pr['eta']:.3g}, K = {pr['K']}, {pr['runs']} runs", fontsize=8)
    ax.legend(fontsize=6.5)
    for i, c in enumerate(cc for cc in res["configs"] if "bounds_vs_N" in cc):
        col = f"C{i + 4}"
        ax2.plot(range(len(c["err_curve"])), c["err_curve"], color=col, lw=1.8, label=f"{c['name']}: measured mean")
        bv = c["bounds_vs_N"]
        ax2.plot(bv["N"], bv["upper"], "-.", color=col, lw=0.8, label=f"{c['name']}: upper from x₀")
        ax2.plot(bv["N"], bv["restart_upper"], "--", color=col, lw=1.2, label=f"{c['name']}: upper, tightest restart")
        ax2.plot(bv["N"], bv["restart_lower"], ":", color=col, lw=1.2, label=f"{c['name']}: lower, tightest restart")
    ax2.set_yscale("log")
    ax2.set_xlabel("N (steps)")
    ax2.set_ylabel("E[F(x_N) − F*]")
    ax2.set_title("mean error and Theorem 1 bounds (valid constants) at every horizon N", fontsize=8)
    ax2.legend(fontsize=6.5)
    _caption(fig, f"made by: {cmd}")
    fig.savefig(path, dpi=110, metadata={"Software": None})


def plot_prop1(res: dict[str, Any], path: Path, cmd: str) -> None:
    fig = _fig(7.5, 5.0)
    ax = fig.add_subplot()
    for i, (name, pts) in enumerate(res["series"].items()):
        b = [p["bits"] + (i - 1.5) * 0.06 for p in pts]
        m = [p["ratio_mean"] for p in pts]
        lo = [p["ratio_mean"] - p["ratio_min"] for p in pts]
        hi = [p["ratio_max"] - p["ratio_mean"] for p in pts]
        ax.errorbar(b, m, yerr=[lo, hi], fmt="o-", ms=4, lw=1, capsize=2, color=f"C{i}",
                    label=f"{name} (mean, min–max over vectors)")
    ax.axhline(1.0, color="k", lw=1, label="Proposition 1: d‖g‖²/(6s²)")
    ax.axhline(1.5, color="k", lw=1, ls="--", label="worst case d‖g‖²/(4s²)")
    ax.axhline(res["assumption_expected_ratio"], color="0.5", lw=1, ls=":", label="(d − 1)/d (p = ∞, max coordinate exact)")
    ax.set_yscale("log")
    ax.set_xlabel("bits B (s = 2^(B−1) − 1)")
    ax.set_ylabel("measured E‖Q(g) − g‖² / (d‖g‖_p²/(6s²))")
    ax.set_title(f"Proposition 1, real quantizer, d = {res['d']}, {res['vectors_per_set']} vectors × "
                 f"{res['draws_per_vector']} draws per point", fontsize=8)
    ax.legend(fontsize=6.5)
    _caption(fig, f"made by: {cmd}")
    fig.savefig(path, dpi=110, metadata={"Software": None})


def plot_equal_bits(res: dict[str, Any], path: Path, cmd: str) -> None:
    fig = _fig(15.0, 4.6)
    ax, ax2, ax3 = fig.subplots(1, 3)
    rows = res["rows"]
    b = [r["budget_bits"] for r in rows]
    ax.plot(b, [r["quant_term_fixed"] for r in rows], "o-", color="C0", label="fixed B")
    ax.plot(b, [r["quant_term_dqsgd"] for r in rows], "s-", color="C3", label="DQSGD eq. 18 (integer, closed loop)")
    ax.plot(b, [r["quant_term_real_optimum"] for r in rows], "^:", color="C2",
            label="real-valued optimum (optimal_real_bits)")
    ax.set_yscale("log")
    ax.set_xlabel("mean bits per coordinate (equal total bits)")
    ax.set_ylabel("Σ_n w_n E‖g_n‖²/s_n²  (Theorem 1 upper, quantization term)")
    ax.set_title("bound: quantization term", fontsize=9)
    ax.legend(fontsize=7)
    ax2.errorbar([x - 0.03 for x in b], [r["measured_fixed"] for r in rows], yerr=[r["se_fixed"] for r in rows],
                 fmt="o-", color="C0", capsize=3, label="fixed B: measured ± SE")
    ax2.errorbar([x + 0.03 for x in b], [r["measured_dqsgd"] for r in rows], yerr=[r["se_dqsgd"] for r in rows],
                 fmt="s-", color="C3", capsize=3, label="DQSGD: measured ± SE")
    ax2.set_yscale("log")
    ax2.set_xlabel("mean bits per coordinate (equal total bits)")
    ax2.set_ylabel("E[F(x_N) − F*] (measured)")
    ax2.set_title("measurement: final error", fontsize=9)
    ax2.legend(fontsize=7)
    for i, r in enumerate(rows):
        ax3.plot(r["dqsgd_bits_profile"], color=f"C{i}", lw=1.5, label=f"DQSGD, B̄ = {r['budget_bits']} (mean over runs)")
        ax3.plot(r["real_optimum_bits"], color=f"C{i}", lw=1, ls=":", label=f"real-valued optimum, B̄ = {r['budget_bits']}")
    ax3.set_xlabel("step n")
    ax3.set_ylabel("bits per coordinate B_n")
    ax3.set_title("widths chosen", fontsize=9)
    ax3.legend(fontsize=7)
    _caption(fig, f"made by: {cmd}")
    fig.savefig(path, dpi=110, metadata={"Software": None})


# ---------------------------------------------------------------- report

def _g(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}g}"


def write_report(res: dict[str, Any], path: Path) -> None:
    cmd = res["command"]
    t2, t1, p1, eq = res["theorem2"], res["theorem1"], res["proposition1"], res["equal_bits"]
    h = t2["headline"]
    pr = t1["problem"]
    ins = t1["inside"]
    L: list[str] = []
    a = L.append
    a("# DQSGD theory checks\n")
    a(f"Made by `{cmd}` (seed {res['settings']['seed']}, {res['elapsed_s']:.0f} s wall clock, one torch thread). "
      "Every figure below was drawn by that command, and `results.json` holds all the numbers. "
      "`dqsgd.theory` gives the bounds, and `dqsgd.quantizers.quantize_uniform` is the quantizer.\n")
    a("## Headline numbers\n")
    a(f"* **Theorem 2**: formula {_g(h['formula'])} vs measured {_g(h['measured'])} ± {_g(h['se'], 2)} "
      f"(N = {h['N']}, B = {h['bits']}, {t2['setting']['runs']} runs, z = {h['z']:+.2f}). Over all "
      f"{len(t2['isotropic']) + 1} cases (widths {', '.join(str(r['bits']) for r in t2['isotropic'])} and one "
      f"anisotropic H) the largest |z| is {t2['max_abs_z']:.2f}.")
    a(f"* **Theorem 1**: the measured error lies inside [lower, upper] in **{ins['valid'][0]} of {ins['valid'][1]}** "
      f"configurations with constants that meet the proofs' conditions, from x₀. It also lies inside in "
      f"**{ins['restart'][0]} of {ins['restart'][1]}** with the tightest restart point. With the constants "
      f"as printed (one σ² = sup for both bounds, cell factor 1/6) it lies inside in {ins['printed'][0]} of "
      f"{ins['printed'][1]}; there the lower bound's conditions do not hold.")
    for r in eq["rows"]:
        a(f"* **DQSGD vs fixed, B̄ = {r['budget_bits']}** (DQSGD spends {r['dqsgd_mean_bits']:.3f} bits/coordinate): "
          f"bound's quantization term {_g(r['quant_term_dqsgd'], 3)} vs {_g(r['quant_term_fixed'], 3)} "
          f"(×{r['bound_ratio_dqsgd_over_fixed']:.3g}; real-valued optimum {_g(r['quant_term_real_optimum'], 3)}); "
          f"measured final error {_g(r['measured_dqsgd'])} ± {_g(r['se_dqsgd'], 2)} vs {_g(r['measured_fixed'])} ± "
          f"{_g(r['se_fixed'], 2)} (×{r['measured_ratio_dqsgd_over_fixed']:.3g}).")
    lg, asm = p1["series"]["logistic p=inf"], p1["series"]["assumption p=inf"]
    l2 = p1["series"]["logistic p=2"]
    a(f"* **Proposition 1**: measured variance / d‖g‖²/(6s²) ranges {min(q['ratio_mean'] for q in lg):.3g}–"
      f"{max(q['ratio_mean'] for q in lg):.3g} on logistic gradients (p = ∞, mean over vectors, B = "
      f"{p1['bits'][0]}..{p1['bits'][-1]}) and {min(q['ratio_mean'] for q in asm):.3g}–"
      f"{max(q['ratio_mean'] for q in asm):.3g} on vectors meeting the assumption (expected (d−1)/d = "
      f"{p1['assumption_expected_ratio']:.3g}). With p = 2 at B = 2 it is only {l2[0]['ratio_mean']:.3g}. "
      f"No vector exceeds the worst case d‖g‖²/(4s²) (largest measured/worst = "
      f"{max(q['max_over_worst_case'] for ser in p1['series'].values() for q in ser):.3g}).\n")

    a("## 1. Theorem 2 (quadratics): exact\n")
    st = t2["setting"]
    a(f"F(x) = ½λ‖x − x*‖² with d = {st['d']}, λ = {st['lambda']}, η = {st['eta']}, and x₀ − x* ~ N(0, I) "
      f"(seeded). Each step quantizes g = ∇F(x) + ξ, ξ ~ N(0, {st['sampling_var_per_coord']}·I), with the real "
      f"stochastic uniform quantizer (p = ∞). There are {st['runs']} runs per width, simulated as one batch. The "
      "noise ε = Q(g) − ∇F(x) is not Gaussian, and its covariance depends on x_n. Theorem 2's identity only "
      "needs E[ε_n | past] = 0 and Cov ε_n = Σ_n. Here **Σ_n = vI + E_runs diag((r/s)² f_i(1 − f_i))**: the exact "
      "conditional quantization variance of every run at step n, averaged over runs. It is not a Gaussian "
      "recursion fixed in advance. The formula is `theorem2_isotropic`; the anisotropic row uses "
      "`theorem2_expected_error`.\n")
    a("| B | formula | measured ± SE | z | paired diff ± SE | formula with Prop. 1's d‖g‖∞²/(6s²) |")
    a("|---|---|---|---|---|---|")
    for r in t2["isotropic"]:
        f = r["final"]
        a(f"| {r['bits']} | {_g(f['formula'])} | {_g(f['measured'])} ± {_g(f['se'], 2)} | {f['z']:+.2f} | "
          f"{_g(f['paired_diff'], 2)} ± {_g(f['paired_se'], 2)} | {_g(f['formula_prop1'])} |")
    an = t2["anisotropic"]
    a(f"| {an['bits']}, H = {an['H']} | {_g(an['formula'])} | {_g(an['measured'])} ± {_g(an['se'], 2)} | "
      f"{an['z']:+.2f} | {_g(an['paired_diff'], 2)} ± {_g(an['paired_se'], 2)} | – |\n")
    a(f"Values at N = {st['N']}. z = (measured − formula)/SE. *Paired diff* is the run-mean of F(x_N) − F* minus "
      "that run's own formula value (its own conditional variances). Its expectation is exactly 0. The last "
      "column replaces the exact trace with Proposition 1's d‖g‖∞²/(6s²), which is not the quantizer's "
      "variance (§3).\n")
    a(f"![Theorem 2](theorem2.png)\n\n*Figure 1. Top: E[F(x_N) − F*] vs N for each width. Lines: Theorem 2 fed the "
      f"measured per-step covariances. Points: MC mean ± SE. Bottom: relative deviation measured/formula − 1 "
      f"± SE. Made by `{cmd}`.*\n")

    a("## 2. Theorem 1 (strongly convex): logistic regression\n")
    a(f"The data are {pr['data']}: n = {pr['n']}, d = {pr['d']}, F(x) = mean log(1 + e^(−y aᵀx)) + (λ₂/2)‖x‖², "
      f"λ₂ = {pr['lambda2']}. The constants are global: L = ‖X‖₂²/(4n) + λ₂ = {pr['L']:.4g} and μ = λ₂ = "
      f"{pr['mu']:.4g}. F* = {pr['F_star']:.10g} comes from Newton (‖∇F‖ = {pr['newton_grad_norm']:.1e}). Settings: "
      f"η = {pr['eta_over_1_over_L']}/L = {pr['eta']:.4g}; minibatches of K = {pr['K']} (with replacement); "
      f"N = {pr['N']}; x₀ = 0; {pr['runs']} runs; quantizer p = ∞. Then α = {pr['alpha']:.4f} and "
      f"β = {pr['beta']:.4f}.\n")
    a("Conditions (docstrings of `theorem1_upper/lower_terms`):\n")
    a(f"* both bounds: 0 < μ ≤ L and η ≤ 2/L, here {pr['eta_le_2_over_L']};")
    a(f"* lower bound: β ≥ 0, i.e. η ≤ (1 − √(1 − μ/L))/μ = {pr['beta_nonneg_needs_eta_le']:.4g}, here "
      f"{pr['beta_nonneg']};")
    a("* upper bound: σ² ≥ E σ²(x_n), and a cell factor c ≥ E‖Q − g‖²/(d·E[‖g‖²/s²]), at every step. "
      "c = 1/4 always holds. The printed c = 1/6 (Proposition 1) is an average over g, not a bound;")
    a("* lower bound: the proof uses the variances *with equality* (the `cell_factor` caveat). It is a bound "
      "only if σ² ≤ E σ²(x_n) and c ≤ the measured ratio, at every step.\n")
    a("The three versions:\n")
    a("* **valid, from x₀**. Upper: σ²_up = sup_n E σ²(x_n) and c_up = max_n ratio_n. Lower: σ²_lo = "
      "inf_n E σ²(x_n) and c_lo = min_n ratio_n. Here σ²(x) is the per-sample gradient variance at x, and "
      "ratio_n is the exact conditional quantization variance over d·E[‖g_n‖²/s_n²]. Both are measured and "
      "averaged over runs.")
    a("* **valid, tightest restart**. The proof's one-step inequality holds at every step, so the theorem also "
      "holds for the chain started at any step n₀. The gap is then E[F(x_{n₀}) − F*] (measured), the horizon "
      "N − n₀, and sup/inf run over n ≥ n₀. The table gives the smallest upper and the largest lower over "
      f"n₀ ∈ {{0, N/40, …, N/2}}. This removes the huge σ²(x₀) at x₀ = 0 from the sampling term. Stopping "
      f"at N/2 keeps the measured gap's weight α^(N−n₀) ≤ α^(N/2) = {pr['alpha'] ** (pr['N'] / 2):.2g}, so the "
      "bound does not lean on the measured error it is compared with.")
    a("* **printed**: one σ² = sup for both bounds, with c = 1/6.\n")
    a("Norms are √E‖g_n‖_∞² of the quantized minibatch gradients. For DQSGD, whose widths differ from run to "
      "run, the per-step width is set so that ‖g‖²/s² equals E[‖g_n‖²/s_n²].\n")
    a("| config | mean bits | measured ± SE | valid from x₀ [lower, upper] | in | tightest restart [lower, upper] (n₀) | "
      "in | printed [lower, upper] | in | printed conds up/low | c range |")
    a("|---|---|---|---|---|---|---|---|---|---|---|")
    yn = lambda b: "yes" if b else "**no**"  # noqa: E731
    for c in t1["configs"]:
        v, p, rs, k = (c["bounds"][w] for w in ("valid", "printed", "restart", "constants"))
        a(f"| {c['name']} | {c['mean_bits']:.3f} | {_g(c['measured'])} ± {_g(c['se'], 2)} | "
          f"[{_g(v['lower']['total'], 3)}, {_g(v['upper']['total'], 3)}] | {yn(v['inside'])} | "
          f"[{_g(rs['lower']['total'], 3)} ({rs['lower_start']}), {_g(rs['upper']['total'], 3)} ({rs['upper_start']})] | "
          f"{yn(rs['inside'])} | [{_g(p['lower']['total'], 3)}, {_g(p['upper']['total'], 3)}] | {yn(p['inside'])} | "
          f"{'y' if p['upper_conditions_hold'] else 'n'}/{'y' if p['lower_conditions_hold'] else 'n'} | "
          f"{k['cell_factor_min']:.3f}–{k['cell_factor_max']:.3f} |")
    a("")
    a("Terms of the upper bounds (optimization + sampling + quantization):\n")
    a("| config | from x₀ | tightest restart |")
    a("|---|---|---|")
    for c in t1["configs"]:
        v, rs = c["bounds"]["valid"]["upper"], c["bounds"]["restart"]["upper"]
        a(f"| {c['name']} | {_g(v['optimization'], 3)} + {_g(v['sampling'], 3)} + {_g(v['quantization'], 3)} | "
          f"{_g(rs['optimization'], 3)} + {_g(rs['sampling'], 3)} + {_g(rs['quantization'], 3)} |")
    c0 = t1["configs"][0]["bounds"]["constants"]
    a(f"\nE σ²(x_n) runs from {c0['sigma2_sup']:.4g} at x₀ = 0 down to {c0['sigma2_inf']:.4g} "
      f"({t1['configs'][0]['name']}).\n")
    a(f"![Theorem 1](theorem1.png)\n\n*Figure 2. Left: measured E[F(x_N) − F*] ± SE and Theorem 1's bounds vs mean "
      f"bits; circles are fixed widths and squares DQSGD. Right: the mean error and the valid bounds at every "
      f"horizon N, using prefixes of the same runs. Made by `{cmd}`.*\n")

    a("## 3. Proposition 1: quantization variance\n")
    a(f"E‖Q(g) − g‖² is measured with the real quantizer ({p1['draws_per_vector']} draws per vector, "
      f"{p1['vectors_per_set']} vectors per set, d = {p1['d']}) and divided by d‖g‖_p²/(6s²). The four sets:\n")
    a("* logistic: minibatch gradients of §2 at steps 0, N/4, N/2 and N − 1, quantized with p = ∞ and p = 2;")
    a("* vectors meeting the assumption: g₀ = ±1 is the max coordinate, and |g_i| ~ U(0, 1), so s|g_i| has "
      "uniform fractional parts;")
    a("* mid-cell vectors: f_i = ½, the worst case.\n")
    a("The MC values agree with the closed form `exact_quantization_variance`: the largest relative difference "
      f"for any vector is {p1['max_rel_diff_mc_vs_exact']:.3g}, which is MC noise.\n")
    a("| B | " + " | ".join(p1["series"]) + " |")
    a("|---|" + "---|" * len(p1["series"]))
    for i, b in enumerate(p1["bits"]):
        a(f"| {b} | " + " | ".join(f"{ser[i]['ratio_mean']:.3f} [{ser[i]['ratio_min']:.2f}, {ser[i]['ratio_max']:.2f}]"
                                     for ser in p1["series"].values()) + " |")
    a("\nEach cell is the mean ratio, with [min, max] over the vectors.\n")
    a(f"![Proposition 1](prop1.png)\n\n*Figure 3: measured variance / Proposition 1's d‖g‖²/(6s²), as the mean "
      f"and min–max over the vectors. Dashed line: the worst case d‖g‖²/(4s²). Made by `{cmd}`.*\n")

    a("## 4. DQSGD vs fixed bits at equal total bits\n")
    a("DQSGD uses eq. (18) with the upper bound's α and each run's current ‖g_n‖_∞ (Algorithm 1). Widths are "
      f"rounded to the nearest integer and clipped to [{MIN_BITS}, {MAX_BITS}], as `DQSGDRule` does. k is set "
      "in closed loop: solved on the previous simulation's norms, then simulated again. The run kept is the "
      "one whose mean width over runs and steps comes closest to the fixed width B̄ without exceeding it. "
      "DQSGD sees the same minibatch draws as the fixed-width runs. The quantization term is the upper "
      "bound's Σ_n w_n E‖g_n‖²/s_n², with w_n = (L d η²/12) α^(N−1−n). The real-valued optimum is "
      "`optimal_real_bits` for the fixed run's norms at the same budget C = N(d·B̄ + 32).\n")
    a("| B̄ | DQSGD mean bits | quant. term: fixed | DQSGD | real optimum | DQSGD/fixed | measured: fixed | "
      "DQSGD | DQSGD/fixed | paired DQSGD − fixed |")
    a("|---|---|---|---|---|---|---|---|---|---|")
    for r in eq["rows"]:
        a(f"| {r['budget_bits']} | {r['dqsgd_mean_bits']:.3f} | {_g(r['quant_term_fixed'], 3)} | "
          f"{_g(r['quant_term_dqsgd'], 3)} | {_g(r['quant_term_real_optimum'], 3)} | "
          f"{r['bound_ratio_dqsgd_over_fixed']:.3g} | {_g(r['measured_fixed'])} ± {_g(r['se_fixed'], 2)} | "
          f"{_g(r['measured_dqsgd'])} ± {_g(r['se_dqsgd'], 2)} | {r['measured_ratio_dqsgd_over_fixed']:.3g} | "
          f"{_g(r['paired_diff'], 3)} ± {_g(r['paired_diff_se'], 2)} |")
    a("\nThe paired difference is the per-run final error of DQSGD minus that of the fixed width, with the "
      "same minibatch draws. Its SE is smaller than that of either mean.\n")
    a(f"![DQSGD vs fixed](dqsgd_vs_fixed.png)\n\n*Figure 4. Left: the bound's quantization term at equal total "
      f"bits. Middle: the measured final error. Right: the widths per step, DQSGD's (mean over runs) and the real-valued optimum's. Made by `{cmd}`.*\n")

    a("## Notes: where a bound is loose or does not apply, and why\n")
    for note in res["notes"]:
        a(f"* {note}")
    a("")
    path.write_text("\n".join(L))


def _notes(res: dict[str, Any]) -> list[str]:
    t2, t1, p1, eq = res["theorem2"], res["theorem1"], res["proposition1"], res["equal_bits"]
    pr, cf = t1["problem"], t1["configs"]
    notes = []
    notes.append(
        f"Theorem 2 is an identity for martingale-difference noise, and the measurements agree (largest |z| = "
        f"{t2['max_abs_z']:.2f}). It is predictive only given Σ_n, which depends on the state: the formula here is "
        "fed the measured per-step covariances. Replacing them with Proposition 1's d‖g‖∞²/(6s²) changes the "
        "prediction by up to "
        f"{max(abs(r['final']['formula_prop1'] / r['final']['formula'] - 1) for r in t2['isotropic']):.1%}.")
    for w, label in (("valid", "from x₀"), ("restart", "tightest restart")):
        bad = [c["name"] for c in cf if not c["bounds"][w]["inside"]]
        if bad:
            notes.append(f"Theorem 1 ({label}, conditions met) does NOT contain the measurement for {bad}; see the table.")
    r0 = [c["bounds"]["valid"]["upper_over_measured"] for c in cf]
    rr = [c["bounds"]["restart"]["upper_over_measured"] for c in cf]
    lr = [c["bounds"]["restart"]["measured_over_lower"] for c in cf]
    s = cf[0]["bounds"]["constants"]
    notes.append(
        f"Theorem 1 is loose. From x₀ the upper bound is {min(r0):.3g}–{max(r0):.3g}× the measured error. Its "
        f"sampling term uses one σ² for all steps, and that σ² must cover E σ²(x₀) = {s['sigma2_sup']:.3g}, while "
        f"near x* it is {s['sigma2_inf']:.3g}. Restarting the theorem late removes most of this: "
        f"{min(rr):.3g}–{max(rr):.3g}×. What remains comes from μ = λ₂ = {pr['mu']:.3g} (global strong convexity) and "
        f"L = {pr['L']:.3g} (global smoothness): 1 − α = {1 - pr['alpha']:.3g} is smaller than the local "
        f"contraction, and the sampling term is Lη²σ²/(2K(1 − α)). The lower bound is {min(lr):.3g}–{max(lr):.3g}× "
        f"below the measurement. With β = {pr['beta']:.3g} it only counts the last one or two steps' noise, "
        "scaled by μ instead of the curvature.")
    bad_up = [c["name"] for c in cf if not c["bounds"]["printed"]["upper_conditions_hold"]]
    cmax = max(c["bounds"]["constants"]["cell_factor_max"] for c in cf)
    cmin = min(c["bounds"]["constants"]["cell_factor_min"] for c in cf)
    notes.append(
        f"Measured cell factors E‖Q − g‖²/(d·E[‖g‖²/s²]) lie in {cmin:.3f}–{cmax:.3f}, against Proposition 1's 1/6 = "
        "0.1667. "
        + (f"The printed upper bound's condition (c ≤ 1/6 at every step) fails for {bad_up} (by up to "
           f"{cmax - 1 / 6:.1e}, i.e. {cmax * 6 - 1:.1%}), so for them the proof does not cover the printed bound, "
           "even where it lies above the measurement. "
           if bad_up else "The printed upper bound's condition (c ≤ 1/6 at every step) holds for every configuration. ")
        + "With p = ∞ the max coordinate is always exact, which pulls c below 1/6. Non-uniform fractional parts "
        "can push it either way.")
    n_low_ok = sum(c["bounds"]["printed"]["lower_conditions_hold"] for c in cf)
    notes.append(
        "The printed lower bound (one σ² = sup, c = 1/6) is not a valid lower bound here: σ²(x) falls along the "
        f"trajectory, so σ² = sup overstates the late noise. Its conditions hold in {n_low_ok} of {len(cf)} "
        f"configurations, and it lies above the measurement in "
        f"{sum(c['bounds']['printed']['lower']['total'] > c['measured'] for c in cf)} of {len(cf)}.")
    notes.append(
        f"The 'valid' constants (sup/inf of E σ²(x_n), max/min of the cell factor) are MC estimates over "
        f"{pr['runs']} runs, as are the norms. The bounds are therefore exact only up to that MC error, which is "
        "far smaller than the gaps between the bounds and the measurement.")
    worse = [r for r in eq["rows"] if r["bound_ratio_dqsgd_over_fixed"] > 1]
    where = ("is smaller for DQSGD at every budget" if not worse
             else f"is NOT smaller for DQSGD at B̄ = {[r['budget_bits'] for r in worse]}")
    bratios = ", ".join(f"{r['bound_ratio_dqsgd_over_fixed']:.3g}" for r in eq["rows"])
    mratios = ", ".join(f"{r['measured_ratio_dqsgd_over_fixed']:.3g}" for r in eq["rows"])
    zs = ", ".join(f"{r['paired_diff'] / r['paired_diff_se']:+.1f}" for r in eq["rows"])
    sig = (": every improvement is beyond MC noise, but small"
           if all(r["paired_diff"] < -3 * r["paired_diff_se"] for r in eq["rows"]) else "")
    notes.append(
        f"DQSGD vs fixed: the bound's quantization term {where} (×{bratios}). The weights α^(N−1−n) "
        f"(α = {pr['alpha']:.4f}) span a factor {pr['alpha'] ** -(pr['N'] - 1):.2g} over N = {pr['N']} steps, "
        "so eq. 18 puts the extra bits on the last steps. The measured final error improves much less "
        f"(×{mratios}; paired differences {zs} SE{sig}). Quantization is only part of the final error: the sampling noise σ²/K is untouched by "
        "bit allocation, and at B̄ ≥ 4 the fixed widths' quantization noise is already small.")
    notes.append(
        "The real-valued optimum (`optimal_real_bits`) is a relaxation for reference, not an achievable value. It "
        f"allows widths below 2 bits (down to {min(r['real_optimum_min_bits'] for r in eq['rows']):.3g}; s < 1 has "
        "no quantizer) and non-integer widths, and it uses the fixed run's norms. DQSGD can land slightly above "
        "or below it, because its own norms differ.")
    l2 = p1["series"]["logistic p=2"][0]
    notes.append(
        "Proposition 1's d‖g‖²/(6s²) assumes uniform fractional parts. With p = ∞ the largest coordinate is "
        "quantized exactly, so vectors meeting the assumption give (d−1)/d. Logistic gradients come close "
        "for p = ∞ at every B. With p = 2 and B = 2 (s = 1), f_i = |g_i|/‖g‖₂ is small for most coordinates, "
        f"and the variance is only {l2['ratio_mean']:.2f}× the prediction. Mid-cell vectors (f = ½) reach "
        "1.5·(d−1)/d, the worst case. No vector exceeds d‖g‖²/(4s²).")
    notes.append(
        "Not covered: Theorem 3 and eq. 20 (non-convex). `BudgetedDQSGD` (online k) is not simulated, because "
        "its per-run Python loop is too slow for thousands of runs; DQSGD's k is set with hindsight, in closed "
        "loop, here. DQSGD uses the current gradient's norm (Algorithm 1), not Algorithm 2's one-step lag "
        "(`DQSGDRule`). Only p = ∞ drives the training runs.")
    return notes


# ---------------------------------------------------------------- entry point

def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def run_theory_checks(out: Path, quick: bool = False) -> dict[str, Any]:
    """Run all four checks, write ``results.json``, the PNGs and ``report.md`` under ``out``; return the results."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    S = QUICK if quick else FULL
    cmd = _command(out, quick)
    t0 = time.perf_counter()
    clock: dict[str, float] = {}

    def lap(name: str, start: float) -> float:
        now = time.perf_counter()
        clock[name] = now - start
        return now

    t = t0
    t2 = theorem2_check(S)
    t = lap("theorem2", t)
    t1 = theorem1_check(S)
    eq = equal_bits_check(S, t1)
    t = lap("theorem1_and_equal_bits", t)
    grads = t1["_sims"][f"fixed-{S.fixed_bits[0]}"]["kept"][: S.p1_vectors]
    p1 = proposition1_check(S, grads)
    t = lap("proposition1", t)
    res: dict[str, Any] = {"command": cmd, "quick": quick, "settings": asdict(S), "theorem2": t2, "theorem1": t1,
                           "proposition1": p1, "equal_bits": eq}
    res["notes"] = _notes(res)
    res["checks"] = {
        "theorem2_within_4se": all(abs(r["final"]["z"]) <= 4 for r in t2["isotropic"]) and abs(t2["anisotropic"]["z"]) <= 4,
        "theorem1_inside_where_conditions_hold": all(
            c["bounds"][w]["inside"] for c in t1["configs"] for w in ("printed", "valid")
            if c["bounds"][w]["upper_conditions_hold"] and c["bounds"][w]["lower_conditions_hold"]),
        "dqsgd_bound_le_fixed": all(r["quant_term_dqsgd"] <= r["quant_term_fixed"] for r in eq["rows"]),
        "dqsgd_bits_le_fixed": all(r["dqsgd_mean_bits"] <= r["budget_bits"] + 1e-9 for r in eq["rows"]),
    }
    plots = {"theorem2": "theorem2.png", "theorem1": "theorem1.png", "proposition1": "prop1.png",
             "equal_bits": "dqsgd_vs_fixed.png"}
    plot_theorem2(t2, out / plots["theorem2"], cmd)
    plot_theorem1(t1, out / plots["theorem1"], cmd)
    plot_prop1(p1, out / plots["proposition1"], cmd)
    plot_equal_bits(eq, out / plots["equal_bits"], cmd)
    res["plots"] = plots
    lap("plots", t)
    res["elapsed_s"] = time.perf_counter() - t0
    res["seconds"] = clock
    clean = _jsonable(res)
    (out / "results.json").write_text(json.dumps(clean, indent=1))
    write_report(clean, out / "report.md")
    return clean


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dqsgd.experiments.theory_checks", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/theory"), help="output folder (default runs/theory)")
    ap.add_argument("--quick", action="store_true", help="fewer runs and budgets (≈ 20 s)")
    args = ap.parse_args(argv)
    res = run_theory_checks(args.out, quick=args.quick)
    print(f"wrote {args.out}/report.md, results.json and {len(res['plots'])} figures in {res['elapsed_s']:.0f} s")
    for k, v in res["checks"].items():
        print(f"  {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
