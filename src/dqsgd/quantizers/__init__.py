"""Quantizers: pure functions (tensor, bits, generator) -> :class:`Quantized` and back."""

from typing import TYPE_CHECKING

from dqsgd._lazy import attach

if TYPE_CHECKING:
    from dqsgd.quantizers._common import NonFiniteGradientError
    from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme, dequantize
    from dqsgd.quantizers.identity import quantize_identity
    from dqsgd.quantizers.lowprec import quantize_lowprec
    from dqsgd.quantizers.sign import majority_vote, quantize_sign
    from dqsgd.quantizers.ternary import quantize_ternary, ternary_scalers
    from dqsgd.quantizers.uniform import levels_for_bits, quantize_uniform

__getattr__, __dir__, __all__ = attach(__name__, __file__)
