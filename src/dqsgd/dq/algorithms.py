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

from dqsgd.dq.gradq import Fp32Grad, GradCodec, LowPrecGrad, SparseLowPrecGrad
from dqsgd.dq.modelq import FP32_MODEL, ModelPrecision
from dqsgd.timeouts import DQ_WAIT_S

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
        checks = [
            (self.algorithm in ALGORITHMS, f"algorithm must be one of {sorted(ALGORITHMS)}"),
            (1 <= self.workers <= 64, "workers must be in 1..64"), (self.epochs >= 1, "epochs must be >= 1"),
            (self.inner == 0 or self.inner >= self.workers, "inner must be 0 or >= workers"),
            (self.lr > 0 and self.batch >= 1, "lr > 0 and batch >= 1"), (2 <= self.grad_bits <= 16, "grad_bits in 2..16"),
            (self.mu > 0 and math.isfinite(self.mu), "mu must be > 0"), (2 <= self.bx_max <= 16, "bx_max in 2..16"),
            (self.phi_div >= 1, "phi_div must be >= 1"), (self.tau >= 0, "tau must be >= 0"),
            (0 <= self.theta <= 1, "theta in [0, 1] (0 = schedule)"),
            (self.delay in ("exp", "lognormal"), "delay must be 'exp' or 'lognormal'"),
            (self.compute_s > 0 and self.bandwidth_bps >= 0 and self.delay_sigma >= 0, "delay parameters"),
            (self.eval_every >= 1 and self.max_updates >= 0, "eval_every >= 1, max_updates >= 0"),
            (self.transport in ("sim", "torch"), "transport must be 'sim' or 'torch'"),
            (self.timeout_s > 0, "timeout_s > 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"run config: {msg} (got {self!r})")

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
