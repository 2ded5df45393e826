"""Theorem 1's bounds on a simulated logistic run, in the printed, valid and restarted versions."""

from __future__ import annotations

from typing import Any

import torch

import dqsgd.theory.formulas as T
from dqsgd.theory.sims import Logistic


def effective_widths(sim: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step (norms, bits) for the theory functions: norms = √E‖g_n‖², and bits such that
    ‖g‖²/s² gives E[‖g_n‖²/s_n²]. The widths may differ between runs (DQSGD)."""
    norms = sim["g2"].sqrt()
    s_eff = (sim["g2"] / sim["g2_s2"]).sqrt()
    return norms, T.bits_for_levels(s_eff, torch.log2)


def _bound_inputs(P: Logistic, sim: dict[str, torch.Tensor], start: int, N: int) -> dict[str, Any]:
    norms, bits = effective_widths(sim)
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
