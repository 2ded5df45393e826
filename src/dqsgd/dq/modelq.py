"""Model quantization for the downlink (master → worker): the μ-rule policy and its quantizer.

Double Quantization (Yu, Wu, Huang, NeurIPS 2019) sends the *model* in low precision too. The
condition it enforces [third-party summary, docs/algorithms.md §9.0]:

    E‖Q_(δx,bx)(x) − x‖² ≤ μ‖x − x̃‖²          (x̃: the epoch's snapshot, held by every worker in fp32)

We meet it through the LP variance bound of :func:`dqsgd.quantizers.quantize_lowprec`
(E‖Q(x) − x‖² ≤ d·δ²/4, docs/algorithms.md §1.2) with the no-clipping step δ_x = ‖x‖_∞/(2^(b_x−1) − 1):
d·δ_x²/4 ≤ μ‖x − x̃‖² ⇔ 2^(b_x−1) − 1 ≥ √d·‖x‖_∞/(2√μ·‖x − x̃‖₂), i.e. the smallest width is

    b_x = 1 + ⌈log2(1 + √d·‖x‖_∞ / (2√μ·‖x − x̃‖₂))⌉,   at least 2, capped at b_x,max   [OC rule, §9.2]

Fallbacks [OC]: x = x̃ → a 1-byte "use snapshot" message (the worker already holds x̃ in fp32);
the rule asks for more than b_x,max bits → the model goes in fp32.
Option [OC, off by default]: ``centred`` quantizes x − x̃ instead of x (HALP's bit-centring):
the same rule with ‖x − x̃‖_∞ in place of ‖x‖_∞; the worker adds its fp32 x̃ back.

The policy (:func:`choose_model_precision`) and the quantizer (:func:`encode_model` /
:func:`decode_model`) are separate pieces, so "double quantization" is just this downlink pair
composed with a gradient codec (:mod:`dqsgd.dq.gradq`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from dqsgd.codecs import Coding, PayloadError, decode, encode
from dqsgd.quantizers import Scheme, dequantize, levels_for_bits, quantize_identity, quantize_lowprec
from dqsgd.quantizers.lowprec import MAX_BITS, MIN_BITS

__all__ = [
    "SNAPSHOT_FLAG", "ModelKind", "ModelChoice", "ModelPrecision", "FP32_MODEL",
    "mu_rule_bits", "choose_model_precision", "encode_model", "decode_model",
]

SNAPSHOT_FLAG = b"S"  # the whole 1-byte message; codec payloads start with b"DQ", so no ambiguity


class ModelKind(enum.Enum):
    SNAPSHOT = "snapshot"  # x = x̃: 1-byte flag
    LOWPREC = "lowprec"    # LP(δ_x, b_x) codes through the project codec (FIXED coding)
    FP32 = "fp32"          # raw float32 through the project codec (IDENTITY)


@dataclass(frozen=True)
class ModelPrecision:
    """The downlink policy. ``mu = None``: always fp32 (AsyFPG, QSVRG); else the μ-rule.

    Fields:
      mu: μ of the condition E‖Q(x) − x‖² ≤ μ‖x − x̃‖² [third-party]; default 0.5 [OC, §9.1].
      max_bits: b_x,max; above it the model goes in fp32 [OC]; ≤ 16 (the LP quantizer's limit).
      centred: quantize x − x̃ (HALP-style) instead of x [OC option, not the default].
    """

    mu: float | None = 0.5
    max_bits: int = 16
    centred: bool = False

    def __post_init__(self) -> None:
        if self.mu is not None and not (self.mu > 0 and math.isfinite(self.mu)):
            raise ValueError(f"model precision: mu must be a finite number > 0, got {self.mu}")
        if not MIN_BITS <= self.max_bits <= MAX_BITS:
            raise ValueError(f"model precision: max_bits must be in [{MIN_BITS}, {MAX_BITS}], got {self.max_bits}")


FP32_MODEL = ModelPrecision(mu=None)


@dataclass(frozen=True)
class ModelChoice:
    """What the policy picked for one downlink message."""

    kind: ModelKind
    bits: int            # b_x for LOWPREC, 32 for FP32, 0 for SNAPSHOT
    rule_bits: int       # what the μ-rule asked for before the cap (0 when not applicable)
    delta: float         # δ_x (LOWPREC only, else 0)


def mu_rule_bits(x_inf: float, diff_l2: float, d: int, mu: float) -> int:
    """Smallest b ≥ 2 with d·δ²/4 ≤ μ·diff², δ = x_inf/(2^(b−1) − 1) (uncapped; diff_l2 > 0).

    Computed in closed form, then checked against the inequality itself and raised if float
    rounding left it one short (so the guarantee holds exactly, not up to rounding).
    """
    if diff_l2 <= 0:
        raise ValueError("mu_rule_bits needs ‖x − x̃‖ > 0 (x = x̃ is the snapshot fallback)")
    if x_inf == 0.0:
        return MIN_BITS
    ratio = math.sqrt(d) * x_inf / (2.0 * math.sqrt(mu) * diff_l2)
    b = max(MIN_BITS, 1 + math.ceil(math.log2(1.0 + ratio)))
    while b < 64 and d * (x_inf / levels_for_bits(b)) ** 2 / 4.0 > mu * diff_l2 * diff_l2:
        b += 1
    return b


def choose_model_precision(x: torch.Tensor, x_tilde: torch.Tensor, policy: ModelPrecision) -> ModelChoice:
    """The policy: which message carries ``x`` to a worker that holds ``x_tilde`` in fp32."""
    diff = x.reshape(-1) - x_tilde.reshape(-1)
    diff_l2 = float(torch.linalg.vector_norm(diff.double()))
    if diff_l2 == 0.0:
        return ModelChoice(ModelKind.SNAPSHOT, 0, 0, 0.0)
    if policy.mu is None:
        return ModelChoice(ModelKind.FP32, 32, 0, 0.0)
    src = diff if policy.centred else x.reshape(-1)
    x_inf = float(src.abs().max())
    if not (math.isfinite(x_inf) and math.isfinite(diff_l2)):
        raise ValueError("model quantization: the model is not finite")
    b = mu_rule_bits(x_inf, diff_l2, x.numel(), policy.mu)
    if b > policy.max_bits:
        return ModelChoice(ModelKind.FP32, 32, b, 0.0)
    return ModelChoice(ModelKind.LOWPREC, b, b, x_inf / levels_for_bits(b))


def encode_model(
    x: torch.Tensor, x_tilde: torch.Tensor, policy: ModelPrecision, generator: torch.Generator | None
) -> tuple[bytes, ModelChoice]:
    """Quantize ``x`` under ``policy`` and return (wire bytes, the choice made)."""
    choice = choose_model_precision(x, x_tilde, policy)
    if choice.kind is ModelKind.SNAPSHOT:
        return SNAPSHOT_FLAG, choice
    if choice.kind is ModelKind.FP32:
        return encode(quantize_identity(x.reshape(-1)), Coding.FIXED), choice
    src = (x - x_tilde) if policy.centred else x
    # δ_x = ‖src‖_∞/(2^(b−1) − 1) is the quantizer's own default step: nothing is clamped.
    q = quantize_lowprec(src.reshape(-1), choice.bits, generator)
    return encode(q, Coding.FIXED), choice


def decode_model(payload: bytes, x_tilde: torch.Tensor, policy: ModelPrecision) -> torch.Tensor:
    """The worker's view of the model: x̃ for the flag, else the dequantized message.

    Raises:
      PayloadError: anything that is neither the flag nor a valid codec payload of d elements.
    """
    if payload == SNAPSHOT_FLAG:
        return x_tilde.clone()
    q = decode(payload, max_numel=x_tilde.numel())
    if q.numel != x_tilde.numel() or q.scheme not in (Scheme.IDENTITY, Scheme.LOWPREC):
        raise PayloadError(f"model message: {q.scheme.name} with {q.numel} elements, expected a "
                           f"LOWPREC or IDENTITY model of {x_tilde.numel()}")
    v = dequantize(q).reshape(x_tilde.shape)
    if q.scheme == Scheme.LOWPREC and policy.centred:
        v = v + x_tilde
    return v
