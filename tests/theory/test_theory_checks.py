"""dqsgd.experiments.theory_checks: the quick run's files and the claims its numbers must support.

The quick run is made once per module (≈ 12 s of CPU on one thread). Its limit is on CPU time,
because wall-clock time on the shared 2-core machine depends on what else runs there. The claims
checked are those of the issue: Theorem 2 within 4 MC standard errors; every measured Theorem 1
error inside [lower, upper] wherever the proofs' conditions hold; DQSGD's quantization-term bound no
larger than fixed bits at equal bits. Small unit tests pin the vectorized pieces to the library
functions they stand for.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dqsgd.theory.formulas as T
from dqsgd.experiments import theory_checks as tc
from dqsgd.policies import DQSGDRule, Rounding, integerize
from dqsgd.quantizers import Norm

F64 = torch.float64
PNGS = ("theorem2.png", "theorem1.png", "prop1.png", "dqsgd_vs_fixed.png")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("theory")
    cpu, wall = time.process_time(), time.perf_counter()
    res = tc.run_theory_checks(out, quick=True)
    return {"out": out, "res": res, "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}


# ---------------------------------------------------------------- the quick run

def test_quick_run_is_fast(quick: dict[str, Any]) -> None:
    assert quick["cpu_s"] < 30, f"quick run took {quick['cpu_s']:.1f} s of CPU (wall {quick['wall_s']:.1f} s)"


def test_writes_results_plots_and_report(quick: dict[str, Any]) -> None:
    out: Path = quick["out"]
    for name in ("results.json", "report.md", *PNGS):
        assert (out / name).stat().st_size > 1000, name
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # strict JSON (no NaN/Infinity), and the same numbers as returned
    loaded = json.loads((out / "results.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert loaded == json.loads(json.dumps(quick["res"]))
    report = (out / "report.md").read_text()
    cmd = f"python -m dqsgd.experiments.theory_checks --out {out} --quick"
    assert loaded["command"] == cmd
    for name in PNGS:  # every figure is embedded and its caption names the command
        line = next(i for i, ln in enumerate(report.splitlines()) if f"]({name})" in ln)
        assert cmd in report.splitlines()[line + 2], name
    assert "## Notes" in report and "Headline numbers" in report


def test_theorem2_formula_within_4_standard_errors(quick: dict[str, Any]) -> None:
    t2 = quick["res"]["theorem2"]
    rows = [r["final"] for r in t2["isotropic"]] + [t2["anisotropic"]]
    assert len(rows) == len(tc.QUICK.q_bits) + 1
    for r in rows:
        assert r["se"] > 0
        assert abs(r["measured"] - r["formula"]) <= 4 * r["se"], r
        assert abs(r["paired_diff"]) <= 4 * r["paired_se"], r
    # the whole curve, too (a looser check: 4 SE at each of ~20 horizons per width)
    for row in t2["isotropic"]:
        for p in row["curve"]:
            assert abs(p["measured"] - p["formula"]) <= 4 * p["se"] + 1e-12 * p["formula"], (row["bits"], p)
    # more bits, less noise: the formula's error falls with B
    finals = [r["final"]["formula"] for r in t2["isotropic"]]
    assert finals == sorted(finals, reverse=True)


def test_theorem1_measured_error_inside_bounds_where_conditions_hold(quick: dict[str, Any]) -> None:
    t1 = quick["res"]["theorem1"]
    pr = t1["problem"]
    assert pr["beta"] >= 0 and pr["beta_nonneg"] and pr["eta_le_2_over_L"] and 0 < pr["mu"] <= pr["L"]
    assert len(t1["configs"]) == len(tc.QUICK.fixed_bits) + len(tc.QUICK.budgets)
    checked = 0
    for c in t1["configs"]:
        for which in ("valid", "restart", "printed"):
            B = c["bounds"][which]
            if not (B["upper_conditions_hold"] and B["lower_conditions_hold"]):
                continue
            checked += 1
            assert B["lower"]["total"] <= c["measured"] <= B["upper"]["total"], (c["name"], which, B)
        # the valid versions always meet their conditions (constants chosen so), and both are checked
        assert c["bounds"]["valid"]["upper_conditions_hold"] and c["bounds"]["restart"]["lower_conditions_hold"]
        # restarting can only tighten the best bound (n₀ = 0 is among the candidates)
        assert c["bounds"]["restart"]["upper"]["total"] <= c["bounds"]["valid"]["upper"]["total"] * (1 + 1e-12)
        assert c["bounds"]["restart"]["lower"]["total"] >= c["bounds"]["valid"]["lower"]["total"] * (1 - 1e-12)
        # the worst-case cell factor 1/4 gives a larger upper bound than the measured one
        assert c["bounds"]["worst_case"]["upper"]["total"] >= c["bounds"]["valid"]["upper"]["total"]
    assert checked >= 2 * len(t1["configs"])
    assert t1["inside"]["valid"] == [len(t1["configs"])] * 2
    assert quick["res"]["checks"]["theorem1_inside_where_conditions_hold"]


def test_dqsgd_bound_not_above_fixed_bits_at_equal_bits(quick: dict[str, Any]) -> None:
    rows = quick["res"]["equal_bits"]["rows"]
    assert [r["budget_bits"] for r in rows] == list(tc.QUICK.budgets)
    for r in rows:
        assert r["dqsgd_mean_bits"] <= r["budget_bits"] + 1e-9       # never more bits than fixed
        assert r["dqsgd_mean_bits"] >= r["budget_bits"] - 0.1        # ... and not much fewer
        assert r["quant_term_dqsgd"] <= r["quant_term_fixed"], r
        assert r["quant_term_real_optimum"] <= r["quant_term_fixed"], r  # optimum for the fixed run's norms
        assert r["appendix_e_dynamic_GM"] <= r["appendix_e_fixed_AM"]


def test_proposition1_numbers(quick: dict[str, Any]) -> None:
    p1 = quick["res"]["proposition1"]
    assert p1["bits"] == list(range(2, 11))
    assert p1["max_rel_diff_mc_vs_exact"] < 0.15                # MC of the real quantizer vs closed form
    d = p1["d"]
    for name, pts in p1["series"].items():
        for p in pts:
            assert p["exact_ratio_mean"] <= 1.5 + 1e-9, (name, p)   # d‖g‖²/(4s²) is a bound for every g
    for p in p1["series"]["mid-cell p=inf"]:                       # f = ½ on d − 1 coordinates: exactly
        assert p["exact_ratio_mean"] == pytest.approx(1.5 * (d - 1) / d, rel=1e-5)
    for p in p1["series"]["assumption p=inf"]:                     # (d−1)/d on average, up to sampling
        assert abs(p["exact_ratio_mean"] - (d - 1) / d) < 0.08


# ---------------------------------------------------------------- the vectorized pieces

@pytest.mark.parametrize("p,norm", [(math.inf, Norm.MAX), (2.0, Norm.L2)])
def test_cell_variance_and_quantize_rows_match_the_library(p: float, norm: Norm) -> None:
    gen = torch.Generator().manual_seed(3)
    G = torch.randn(5, 9, generator=gen, dtype=F64)
    G[2] = 0.0
    bits = torch.tensor([2, 3, 2, 5, 3])
    s = tc.levels(bits)
    var = tc.cell_variance(G, s, p)
    for i in range(5):
        assert float(var[i].sum()) == pytest.approx(T.exact_quantization_variance(G[i], float(s[i]), p), rel=1e-12, abs=1e-15)
    Q = tc.quantize_rows(G, bits, gen, norm)
    r = tc.row_norms(G.to(torch.float32).to(F64), p)
    assert torch.all(Q[2] == 0)
    for i in (0, 1, 3, 4):  # each row on its own grid r_i/s_i, and within one cell of g
        lv = Q[i].abs() * float(s[i]) / float(r[i])
        assert torch.allclose(lv, lv.round(), atol=1e-4)
        assert float((Q[i] - G[i]).abs().max()) <= float(r[i]) / float(s[i]) * (1 + 1e-5)
    # unbiased, with the closed-form variance (5 SE)
    g = G[3]
    rep = g.expand(20_000, 9).contiguous()
    err = ((tc.quantize_rows(rep, 3, gen, norm) - rep.to(torch.float32).to(F64)) ** 2).sum(1)
    exact = T.exact_quantization_variance(g.to(torch.float32).to(F64), 3, p)
    assert abs(float(err.mean()) - exact) <= 5 * float(err.std()) / math.sqrt(err.numel())


def test_dqsgd_widths_are_eq18_as_in_dqsgd_rule() -> None:
    k, alpha, N = 40.0, 0.97, 50
    rule = DQSGDRule(k=k, total_steps=N, alpha=alpha, convex=True)
    widths = tc.dqsgd_widths(k, alpha, N)
    r = torch.tensor([0.0, 1e-3, 0.05, 0.7, 3.0, 1e4], dtype=F64)
    for n in (0, 17, N - 1):
        got = widths(n, r)
        for j in range(r.numel()):
            real = rule.real_width(n, float(r[j]))
            assert float(tc.dqsgd_real_widths(k, alpha, N, n, r[j:j + 1])[0]) == pytest.approx(real, rel=1e-12)
            assert int(got[j]) == integerize(real, Rounding.NEAREST, 0.0, 2, 16)[0]
    assert float(tc.dqsgd_real_widths(k, alpha, N, 3, r[2:3])[0]) == pytest.approx(
        float(T.dqsgd_convex_bits(torch.full((N,), 0.05, dtype=F64), k, alpha)[3]), rel=1e-12)


def test_solve_k_spends_at_most_the_budget_and_is_largest() -> None:
    gen = torch.Generator().manual_seed(0)
    norms = torch.rand(40, 30, generator=gen, dtype=F64) * torch.logspace(0, -2, 40, dtype=F64).unsqueeze(1)
    for target in (2.5, 3.0, 4.0):
        k = tc.solve_k(norms, 0.95, target)
        n = torch.arange(40, dtype=F64).unsqueeze(1)

        def spend(kk: float) -> float:
            real = tc.dqsgd_real_widths(kk, 0.95, 40, n, norms)
            return float(torch.floor(real + 0.5).clamp(2, 16).mean())
        assert spend(k) <= target < spend(k * 1.01)


def test_logistic_problem_constants() -> None:
    P = tc.make_logistic(0.2)
    c, m = P.coefs(P.xstar)
    assert float((P.X.T @ c / P.n + P.lam2 * P.xstar).norm()) < 1e-10     # F* is a minimum
    sig = torch.sigmoid(m)
    H = (P.X.T * (sig * (1 - sig))) @ P.X / P.n + P.lam2 * torch.eye(P.d, dtype=F64)
    ev = torch.linalg.eigvalsh(H)
    assert P.mu <= float(ev[0]) and float(ev[-1]) <= P.L                    # μ ≤ curvature ≤ L at x*
    H0 = P.X.T @ P.X / (4 * P.n) + P.lam2 * torch.eye(P.d, dtype=F64)       # the largest Hessian (at m = 0)
    assert float(torch.linalg.eigvalsh(H0)[-1]) == pytest.approx(P.L, rel=1e-9)
    assert float(P.value(torch.zeros(1, P.d, dtype=F64))[0]) == pytest.approx(math.log(2.0))


def test_cli_passes_out_and_quick(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The old module's ``main`` (the command) hands --out and --quick to the driver in the package."""
    from dqsgd.theory import checks

    seen = {}

    def fake(out: Path, quick: bool = False) -> dict[str, Any]:
        seen.update(out=out, quick=quick)
        return {"plots": {}, "elapsed_s": 0.0, "checks": {"x": True}}
    monkeypatch.setattr(checks, "run_theory_checks", fake)
    assert tc.main(["--out", str(tmp_path / "t"), "--quick"]) == 0
    assert seen == {"out": tmp_path / "t", "quick": True}


@pytest.mark.parametrize("module", ["dqsgd.experiments.theory_checks", "dqsgd.theory"])
def test_both_module_paths_run_the_command(module: str) -> None:
    """``python -m`` on the old module and on the package reaches the same parser (``--help`` exits 0)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m dqsgd.experiments.theory_checks") and "--quick" in r.stdout
    assert "theory set beside seeded Monte-Carlo measurements" in r.stdout


def test_old_import_path_names_the_package_objects() -> None:
    from dqsgd.theory import checks, cli, settings, sims

    assert tc.run_theory_checks is checks.run_theory_checks and tc.main is cli.main
    assert tc.QUICK is settings.QUICK and tc.quantize_rows is sims.quantize_rows
    assert all(getattr(tc, name) is not None for name in tc.__all__)
