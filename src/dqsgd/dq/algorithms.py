"""The six algorithms as configurations of one asynchronous SVRG engine, and the run settings.

=============  ==================================  ======================  ===========  ======================
algorithm      uplink (gradient)                   downlink (model)        momentum     source
=============  ==================================  ======================  ===========  ======================
asylpg         LP(δ_α, b)                          μ-rule LP(δ_x, b_x)     no           [third-party] + [OC]
sparse-asylpg  LP(δ, b) of S(α), φ = d/phi_div     μ-rule LP(δ_x, b_x)     no           [recalled] + [OC]
acc-asylpg     LP(δ_α, b)                          μ-rule LP of y_t        y_t, θ_s     [OC] (FSVRG/MiG form)
qsvrg          LP(δ_α, b) [OC: LP, not SU]         fp32                    no           [recalled] + [OC]
asyfpg         fp32                                fp32                    no           [third-party]
acc-asyfpg     fp32                                fp32                    y_t, θ_s     [OC]
=============  ==================================  ======================  ===========  ======================

Every default in :class:`RunConfig` is [OC] unless its comment says otherwise (docs/algorithms.md §9.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from dqsgd.core.timeouts import DQ_WAIT_S, check_wait
from dqsgd.dq.gradq import Fp32Grad, GradCodec, LowPrecGrad, SparseLowPrecGrad
from dqsgd.dq.modelq import FP32_MODEL, ModelPrecision

__all__ = ["Algorithm", "ALGORITHMS", "RunConfig", "RUN_FIELDS", "make_codecs"]


@dataclass(frozen=True)
class Algorithm:
    name: str
    grad: str          # "fp32" | "lp" | "sparse-lp"
    model: str         # "fp32" | "mu"
    accelerated: bool
    description: str


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in [
    Algorithm("asylpg", "lp", "mu", False, "AsyLPG: LP gradients (b bits) + μ-quantized model [third-party; rule OC]"),
    Algorithm("sparse-asylpg", "sparse-lp", "mu", False,
              "Sparse-AsyLPG: sparsified (φ = d/phi_div) + LP gradients, μ-quantized model [recalled; format OC]"),
    Algorithm("acc-asylpg", "lp", "mu", True, "Acc-AsyLPG: momentum y_t = θx_t + (1−θ)x̃, LP both ways [OC, FSVRG form]"),
    Algorithm("qsvrg", "lp", "fp32", False, "QSVRG: LP gradients, fp32 model [recalled; LP instead of SU is OC]"),
    Algorithm("asyfpg", "fp32", "fp32", False, "AsyFPG: asynchronous prox-SVRG, fp32 both ways"),
    Algorithm("acc-asyfpg", "fp32", "fp32", True, "Acc-AsyFPG: Acc-AsyLPG with every message fp32 [OC]"),
]}


MAX_EPOCHS = 10_000
MAX_INNER = 10**7        # master updates per epoch (inner = 1e12 never finished)
MAX_UPDATES = 10**8      # master updates of one run in all


@dataclass(frozen=True)
class RunConfig:
    """One run of the engine. Paper names in brackets; all values [OC] unless marked."""

    algorithm: str = "asylpg"
    workers: int = 8               # M (also 4) [OC §9.1]
    epochs: int = 10               # S
    inner: int = 0                 # m master updates per epoch; 0 = n/batch (one pass) [OC]
    lr: float = 0.05               # η (tuned once on AsyFPG, reused by all) [OC]
    batch: int = 32                # B
    grad_bits: int = 4             # b (also 8) [OC]
    mu: float = 0.5                # μ [third-party: ≈ 0.5 best trade-off]
    bx_max: int = 16               # b_x,max [OC]
    centred: bool = False          # quantize x − x̃ instead of x [OC option]
    phi_div: float = 16.0          # φ = d/phi_div [OC]
    tau: int = 0                   # staleness bound τ; 0 = 2M [OC]
    theta: float = 0.5             # θ_s for the accelerated pair; 0 = the schedule 2/(s+4) [OC]
    delay: str = "exp"             # sim compute times: "exp" (Exp, mean compute_s) | "lognormal" [OC]
    delay_sigma: float = 0.5       # log-normal σ [OC]
    compute_s: float = 0.005       # sim: mean gradient compute time, seconds [OC]
    bandwidth_bps: float = 1e9     # sim: per-worker link, bits/s; 0 = instantaneous [OC]
    seed: int = 0
    eval_every: int = 50           # master updates between training-loss evaluations
    target: float = 0.0            # training-loss target (0: none)
    stop_at_target: bool = True    # stop issuing work once the target is reached (drain in-flight)
    max_updates: int = 0           # 0: no cap besides epochs
    transport: str = "sim"         # "sim" | "torch"
    timeout_s: float = DQ_WAIT_S     # torch transport: every wait

    def __post_init__(self) -> None:
        checks = [  # (holds, field, what is allowed)
            (self.algorithm in ALGORITHMS, "algorithm", f"one of {sorted(ALGORITHMS)}"),
            (1 <= self.workers <= 64, "workers", "in 1..64"), (1 <= self.epochs <= MAX_EPOCHS, "epochs", f"in 1..{MAX_EPOCHS}"),
            (self.inner == 0 or self.workers <= self.inner <= MAX_INNER, "inner", f"0 or in workers..{MAX_INNER}"),
            (self.inner * self.epochs <= MAX_UPDATES and 0 <= self.max_updates <= MAX_UPDATES, "inner/max_updates",
             f"at most {MAX_UPDATES:.0e} master updates in all (epochs × inner, max_updates)"),
            (0 < self.lr <= 1e3, "lr", "in (0, 1000]"), (1 <= self.batch <= 1 << 20, "batch", "in 1..2^20"),
            (2 <= self.grad_bits <= 16, "grad_bits", "in 2..16"),
            (0 < self.mu <= 1e6, "mu", "in (0, 1e6]"), (2 <= self.bx_max <= 16, "bx_max", "in 2..16"),
            (1 <= self.phi_div <= 1e9, "phi_div", "in [1, 1e9]"), (0 <= self.tau <= 1 << 20, "tau", "in 0..2^20"),
            (0 <= self.theta <= 1, "theta", "in [0, 1] (0 = schedule)"),
            (self.delay in ("exp", "lognormal"), "delay", "'exp' or 'lognormal'"),
            (0 <= self.delay_sigma <= 10, "delay_sigma", "in [0, 10] (a log-normal σ; exp(10) is already 22026×)"),
            (0 < self.compute_s <= 3600, "compute_s", "in (0, 3600] seconds"),
            (0 <= self.bandwidth_bps <= 1e15, "bandwidth_bps", "in [0, 1e15] (0 = instantaneous)"),
            (1 <= self.eval_every <= MAX_UPDATES, "eval_every", f"in 1..{MAX_UPDATES:.0e}"),
            (self.transport in ("sim", "torch"), "transport", "'sim' or 'torch'"),
            (check_wait("timeout_s", self.timeout_s) is None, "timeout_s", "in (0, 604800] seconds (a week)"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                got = getattr(self, name) if hasattr(self, name) else (self.inner, self.epochs, self.max_updates)
                raise ValueError(f"run config: {name} must be {allowed}, got {got!r}")

    @property
    def staleness_bound(self) -> int:
        return self.tau or 2 * self.workers

    def theta_at(self, epoch: int) -> float:
        return self.theta if self.theta > 0 else 2.0 / (epoch + 4)


RUN_FIELDS = {f.name: f for f in fields(RunConfig)}


def make_codecs(cfg: RunConfig) -> tuple[Algorithm, GradCodec, ModelPrecision]:
    algo = ALGORITHMS[cfg.algorithm]
    grad: GradCodec = {"fp32": Fp32Grad(), "lp": LowPrecGrad(cfg.grad_bits),
                       "sparse-lp": SparseLowPrecGrad(cfg.grad_bits, cfg.phi_div)}[algo.grad]
    model = FP32_MODEL if algo.model == "fp32" else ModelPrecision(cfg.mu, cfg.bx_max, cfg.centred)
    return algo, grad, model
