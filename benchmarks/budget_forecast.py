"""How well does budgeted DQSGD allocate bits online? (the figures quoted in policies/budgeted.py)

    python benchmarks/budget_forecast.py [--seeds 4]

For synthetic norm sequences (log-shape + AR(1) noise, N = 400, d = 2000, budget = 5 bits per
coordinate) it prints the non-convex quantization term Σ‖g_n‖²/s_n² of three allocations relative
to fixed 5-bit QSGD at the same budget:
  * budgeted  — dqsgd's BudgetedDQSGD (online, non-anticipating);
  * lag-1 t*  — eq. (20) with B_{n+1} from ‖g_n‖ and the constant t chosen in hindsight;
  * hindsight — the real-valued optimum with all norms known (dqsgd.theory.optimal_real_bits), rounded.
"""

from __future__ import annotations

import argparse
import math

import torch

from dqsgd.policies import BudgetedDQSGD, GradStats
from dqsgd.quantizers import levels_for_bits
from dqsgd.theory import formulas as theory

SHAPES = {
    "decay": lambda i, n: -i / 120,
    "plateau": lambda i, n: math.log(0.2 + math.exp(-i / 30)),
    "rise": lambda i, n: i / 200,
    "flat": lambda i, n: 0.0,
    "nn-like": lambda i, n: math.log(0.3 + 2 * math.exp(-i / 20) + 0.1 * i / n),
}


def norms_for(shape, n: int, seed: int) -> list[float]:
    gen, e, out = torch.Generator().manual_seed(seed), 0.0, []
    for i in range(n):
        e = 0.9 * e + math.sqrt(1 - 0.81) * 0.3 * float(torch.randn(1, generator=gen))
        out.append(math.exp(shape(i, n) + e))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    n, d, avg = 400, 2000, 5
    cost = lambda b: 8 * (37 + -(-d * b // 8))
    print(f"{'shape':<9}{'budgeted':>10}{'lag-1 t*':>10}{'hindsight':>11}   (quantization term / fixed {avg}-bit)")
    for name, shape in SHAPES.items():
        rows = []
        for seed in range(args.seeds):
            norms = norms_for(shape, n, seed)
            term = lambda bs: sum(g * g / levels_for_bits(b) ** 2 for g, b in zip(norms, bs))
            fixed = term([avg] * n)
            pol = BudgetedDQSGD(n * cost(avg), n, d, cost)
            st, bits = pol.init(), []
            for i, g in enumerate(norms):
                bits.append(st.bits)
                st = pol.update(st, GradStats(i, g, g, cost(st.bits)))
            lg = [math.log2(g) for g in norms]
            c = 0.0
            while True:  # smallest hindsight constant whose lag-1 widths spend the budget
                lag = [avg] + [min(16, max(2, round(c + lg[i]))) for i in range(n - 1)]
                if sum(lag) >= avg * n:
                    break
                c += 0.005
            opt = theory.optimal_real_bits(norms, [1.0] * n, d, n * cost(avg), 37 * 8)
            rows.append((term(bits) / fixed, term(lag) / fixed, term([round(float(b)) for b in opt]) / fixed))
        mean = [sum(r[k] for r in rows) / len(rows) for k in range(3)]
        print(f"{name:<9}{mean[0]:>10.3f}{mean[1]:>10.3f}{mean[2]:>11.3f}")


if __name__ == "__main__":
    main()
