"""Quantizers: pure functions (tensor, bits, generator) -> :class:`Quantized` and back."""

from dqsgd.quantizers._common import NonFiniteGradientError
from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme, dequantize
from dqsgd.quantizers.identity import quantize_identity
from dqsgd.quantizers.lowprec import quantize_lowprec
from dqsgd.quantizers.sign import majority_vote, quantize_sign
from dqsgd.quantizers.ternary import quantize_ternary, ternary_scalers
from dqsgd.quantizers.uniform import levels_for_bits, quantize_uniform

__all__ = [
    "Layout", "Norm", "Quantized", "Scheme", "dequantize", "NonFiniteGradientError",
    "quantize_identity", "quantize_lowprec", "quantize_sign", "majority_vote",
    "quantize_ternary", "ternary_scalers", "quantize_uniform", "levels_for_bits",
]
