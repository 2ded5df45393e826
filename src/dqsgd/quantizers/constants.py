"""Numbers the quantizers share with the layers above them, importable without torch (the method
registry reads them when ``dqsgd methods`` prints its list, which loads no heavy module).
"""

from __future__ import annotations

__all__ = ["TERNGRAD_CLIP", "levels_for_bits"]

# TernGrad's clip factor c: scaler = c·σ of the tensor (CLIP_FACTOR in bingrad_common.py of the authors' code,
# github.com/wenwei202/terngrad; docs/algorithms.md, TernGrad)
TERNGRAD_CLIP = 2.5


def levels_for_bits(bits: int) -> int:
    """s = 2^(B-1) - 1: one sign bit and B-1 level bits [text, DQSGD §3]; B = 1 has one level
    (the stochastic binary quantizer: codes ±1 times the norm).

    The one place this is written: it is also the largest code magnitude of LP(δ, b) and of the
    sparse LP messages of Double Quantization (b ≥ 2). ``dqsgd.theory.real_levels`` is the
    real-valued 2^(B-1) - 1 (0 at B = 1) for widths that are not integers.
    """
    return 1 if bits == 1 else (1 << (bits - 1)) - 1
