"""The four checks, the claims each result must support, and :func:`run_theory_checks`, which runs
them all and writes ``results.json``, the figures and ``report.md``."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import dqsgd.theory.formulas as T
from dqsgd.quantizers import Norm
from dqsgd.theory.plots import plot_equal_bits, plot_prop1, plot_theorem1, plot_theorem2
from dqsgd.theory.report import notes, write_report
from dqsgd.theory.settings import B_PRE, F64, FULL, INF, PLOTTED_T1, QUICK, Settings, command
from dqsgd.theory.sims import (fixed_widths, levels, make_logistic, mc_variance, row_norms, run_dqsgd,
                                          simulate_logistic, simulate_quadratic)
from dqsgd.theory.bounds import best_restart, effective_widths, theorem1_bounds, valid_totals


# ---------------------------------------------------------------- 1. Theorem 2

def theorem2_check(S: Settings) -> dict[str, Any]:
    d, lam, eta, v, N = S.q_dim, S.q_lam, S.q_eta, S.q_noise, S.q_steps
    grid = sorted({0, *range(0, N + 1, max(1, N // 20)), N})
    h_iso = torch.full((d,), lam, dtype=F64)
    rows = []
    for i, bits in enumerate(S.q_bits):
        sim = simulate_quadratic(S, h_iso, bits, S.seed + 100 + 10 * i, grid)
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
    sim = simulate_quadratic(S, h, bits, S.seed + 999, [N])
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



# ---------------------------------------------------------------- 2. Theorem 1

def theorem1_check(S: Settings) -> dict[str, Any]:
    P = make_logistic(S.lr_lam2)
    eta = S.lr_eta_factor / P.L
    K, N, R = S.lr_batch, S.lr_steps, S.lr_runs
    alpha, beta = T.theorem1_alpha_beta(P.L, P.mu, eta)
    beta_max_eta = T.theorem1_lower_max_eta(P.L, P.mu)
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


# ---------------------------------------------------------------- 3. Proposition 1

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
            meas = mc_variance(G32, b, S.p1_draws, gen, nm)
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



# ---------------------------------------------------------------- 4. DQSGD vs fixed at equal bits

def equal_bits_check(S: Settings, t1: dict[str, Any]) -> dict[str, Any]:
    P, sims, pr = t1["_P"], t1["_sims"], t1["problem"]
    eta, N, alpha = pr["eta"], pr["N"], pr["alpha"]
    w = T.convex_weights(N, P.L, P.d, eta, alpha)    # the upper bound's weights; cell factor 1/6
    by_name = {c["name"]: c for c in t1["configs"]}
    rows = []
    for b in S.budgets:
        fx, dq = sims[f"fixed-{b}"], sims[f"dqsgd-{b}"]
        nf, bf = effective_widths(fx)
        nd, bd = effective_widths(dq)
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



def claims(t2: dict[str, Any], t1: dict[str, Any], eq: dict[str, Any]) -> dict[str, bool]:
    """The claims the results must support, each True or False: Theorem 2 within 4 MC standard errors
    in every case; every measured Theorem 1 error inside [lower, upper] wherever the proofs' conditions
    hold; DQSGD's quantization-term bound no larger than fixed bits, at no more mean bits."""
    return {
        "theorem2_within_4se": all(abs(r["final"]["z"]) <= 4 for r in t2["isotropic"]) and abs(t2["anisotropic"]["z"]) <= 4,
        "theorem1_inside_where_conditions_hold": all(
            c["bounds"][w]["inside"] for c in t1["configs"] for w in ("printed", "valid")
            if c["bounds"][w]["upper_conditions_hold"] and c["bounds"][w]["lower_conditions_hold"]),
        "dqsgd_bound_le_fixed": all(r["quant_term_dqsgd"] <= r["quant_term_fixed"] for r in eq["rows"]),
        "dqsgd_bits_le_fixed": all(r["dqsgd_mean_bits"] <= r["budget_bits"] + 1e-9 for r in eq["rows"]),
    }


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
    cmd = command(out, quick)
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
    res["notes"] = notes(res)
    res["checks"] = claims(t2, t1, eq)
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
