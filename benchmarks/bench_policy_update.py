"""Time of one budgeted-policy update (the per-step work on the critical path before the next encode).

    python benchmarks/bench_policy_update.py [--updates 1000] [--repeats 3]

For N = 1000 and 10,000 total steps it runs ``--updates`` consecutive updates from step 0 of
BudgetedDQSGD (non-convex, and convex with alpha = 0.995) and of CodedBudgetedDQSGD on a synthetic
norm sequence (decay with AR(1) noise) and prints the best of ``--repeats`` runs in µs per update.
The coded policy's update also computes the entropies of the (2000-coordinate) gradient. To compare
two versions, run it on each, interleaved, on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from dqsgd.policies import BudgetedDQSGD, CodedBudgetedDQSGD, GradStats

D = 2000


def cost(bits: int) -> int:
    return 8 * (37 + -(-D * bits // 8))


def norms_for(n: int, seed: int = 0) -> list[float]:
    gen, e, out = torch.Generator().manual_seed(seed), 0.0, []
    noise = torch.randn(n, generator=gen).tolist()
    for i in range(n):
        e = 0.9 * e + math.sqrt(1 - 0.81) * 0.3 * noise[i]
        out.append(math.exp(-3.0 * i / n + e))
    return out


def policies(n: int) -> dict[str, BudgetedDQSGD]:
    budget = n * cost(5)
    return {
        "nonconvex": BudgetedDQSGD(budget, n, D, cost),
        "convex": BudgetedDQSGD(budget, n, D, cost, convex=True, alpha=0.995),
        "coded": CodedBudgetedDQSGD(n * cost(2), n, D, cost),
    }


def time_updates(policy: BudgetedDQSGD, norms: list[float], updates: int, grad: torch.Tensor) -> float:
    """Seconds per update over the first ``updates`` steps (each charged half its fixed size)."""
    state = policy.init()
    start = time.perf_counter()
    for n in range(updates):
        g = norms[n]
        state = policy.update(state, GradStats(n, g, g, policy.message_bits(state.bits) // 2, grad * g))
    return (time.perf_counter() - start) / updates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the entropies' small tensors: no thread start-up in the timings
    grad = torch.randn(D, generator=torch.Generator().manual_seed(1)) ** 3
    grad = grad / grad.abs().max()
    print(f"{'policy':<10} {'N':>6} {'us/update':>10}")
    for n in (1000, 10_000):
        norms = norms_for(n)
        for name, policy in policies(n).items():
            best = min(time_updates(policy, norms, min(args.updates, n), grad) for _ in range(args.repeats))
            print(f"{name:<10} {n:>6} {best * 1e6:>10.1f}")


if __name__ == "__main__":
    main()
