"""The DQSGD paper's theory set beside seeded Monte-Carlo measurements, with plots and a report.

The paper's bounds and width rules are plain functions in :mod:`dqsgd.theory.formulas`, whose names
are also this package's (``dqsgd.theory.optimal_real_bits``); the other modules here check them::

    python -m dqsgd.experiments.theory_checks --out runs/theory [--quick]

writes ``results.json``, four PNG figures and ``report.md`` under ``--out``. Every number comes from
:mod:`dqsgd.theory.formulas` (the bounds) and from simulations driven by the real stochastic uniform
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
   proofs' conditions hold (see :func:`dqsgd.theory.bounds.theorem1_bounds`). The third is the valid one, restarted at
   the step n₀ ≤ N/2 that gives the tightest bound.
3. **Proposition 1**: the variance of the real quantizer, measured by MC, divided by d‖g‖²/(6s²),
   for B = 2..10. It is taken on logistic gradients from item 2, on vectors that meet the
   proposition's assumption, and on mid-cell (worst-case) vectors.
4. **DQSGD vs fixed bits at equal total bits**: the bound's quantization term
   Σ w_n E‖g_n‖²/s_n² and the measured final error, for DQSGD (k set so that its mean width is as
   close to the fixed width as it gets without exceeding it) and for fixed widths, with :func:`dqsgd.theory.optimal_real_bits` for reference.

The modules, each reading only those above it: ``formulas`` (the paper's bounds), ``settings`` (the
knobs of the quick and full runs), ``sims`` (the simulations), ``bounds`` (Theorem 1's bounds on a simulated run), ``plots`` (the four
figures), ``report`` (``report.md`` from the JSON results), ``checks`` (the four checks, the claims
the results must support, and :func:`~dqsgd.theory.checks.run_theory_checks`, which runs
them and writes every file), ``cli`` (the command line). ``dqsgd.experiments.theory_checks`` is the
command's module and the old import path of these names.
"""

from typing import TYPE_CHECKING

from dqsgd.core.lazy import attach

if TYPE_CHECKING:
    from dqsgd.theory.formulas import (BoundTerms, bits_for_levels, convex_weights, dqsgd_convex_bits,
                                     dqsgd_nonconvex_bits, error_target_k, error_target_t,
                                     exact_quantization_variance, fixed_vs_dynamic, levels_for_bits,
                                     nonconvex_weights, optimal_real_bits, quantization_term,
                                     quantization_variance_bound, real_levels, theorem1_alpha_beta,
                                     theorem1_lower, theorem1_lower_max_eta, theorem1_lower_terms,
                                     theorem1_upper, theorem1_upper_terms, theorem2_expected_error,
                                     theorem2_isotropic, theorem3_terms, theorem3_upper,
                                     two_stage_quantization_term, two_stage_variance_bound,
                                     worst_case_quantization_variance)

__getattr__, __dir__, __all__ = attach(__name__, __file__)
