"""What the theory checks simulate: the knobs of the quick and full runs, and the constants they share."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

F64 = torch.float64
INF = math.inf
MIN_BITS, MAX_BITS = 2, 16   # the uniform quantizer's range
B_PRE = 32.0                 # bits of a message beyond d·B (one float32 norm), as in Appendix E
PLOTTED_T1 = ("fixed-3", "dqsgd-3")  # configurations whose bounds are drawn vs N


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


def command(out: Path, quick: bool) -> str:
    """The command line that makes these results: the report and every figure name it."""
    return f"python -m dqsgd.experiments.theory_checks --out {out}" + (" --quick" if quick else "")
