"""The simulations behind the theory checks: many seeded runs side by side, one row of an ``(R, d)``
tensor per run, quantized by the real stochastic uniform quantizer (one call per step, one norm per row).

The quadratic of Theorem 2, the logistic problem of Theorem 1 with fixed and DQSGD (eq. 18) widths,
and the Monte-Carlo quantization variance of Proposition 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dqsgd.quantizers import Layout, Norm, dequantize, quantize_uniform
from dqsgd.theory.formulas import bits_for_levels
from dqsgd.theory.settings import F64, INF, MAX_BITS, MIN_BITS, Settings


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


# ---------------------------------------------------------------- Theorem 2's quadratic

def simulate_quadratic(S: Settings, h: torch.Tensor, bits: int, seed: int, grid: list[int]) -> dict[str, Any]:
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
    return bits_for_levels(k * alpha ** ((N - torch.as_tensor(n, dtype=F64)) / 2.0) * r, torch.log2)


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


# ---------------------------------------------------------------- Proposition 1's variance, by MC

def mc_variance(V: torch.Tensor, bits: int, draws: int, gen: torch.Generator, norm: Norm) -> torch.Tensor:
    """E‖Q(g) − g‖² per row of V, by ``draws`` quantizations each (the real quantizer)."""
    rep = V.to(torch.float32).to(F64).repeat_interleave(draws, 0)
    q = quantize_rows(rep, bits, gen, norm)
    return ((q - rep) ** 2).sum(1).view(V.shape[0], draws).mean(1)
