"""Quantizers: pure functions (tensor, bits, generator) -> :class:`Quantized` and back."""

from typing import TYPE_CHECKING

from dqsgd.core.lazy import attach

if TYPE_CHECKING:
    from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme, SchemeQuantizer, dequantize
    from dqsgd.quantizers.constants import TERNGRAD_CLIP, levels_for_bits
    from dqsgd.quantizers.identity import quantize_identity
    from dqsgd.quantizers.lowprec import quantize_lowprec
    from dqsgd.quantizers.registry import QUANTIZERS, Quantizer, quantizer
    from dqsgd.quantizers.segments import NonFiniteGradientError
    from dqsgd.quantizers.sign import majority_vote, quantize_sign
    from dqsgd.quantizers.ternary import quantize_ternary, ternary_scalers
    from dqsgd.quantizers.uniform import quantize_uniform

__getattr__, __dir__, __all__ = attach(__name__, __file__)
