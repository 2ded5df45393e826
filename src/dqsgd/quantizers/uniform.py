"""Stochastic uniform quantization (QSGD; DQSGD eqs. (3)-(4)).

For each segment v with r = ‖v‖_p and s = 2^(B-1) - 1 levels [text, DQSGD §3]:

    a_i = |v_i|/r · s,   l_i = ⌊a_i⌋,   q_i = l_i + 1 with probability a_i - l_i, else l_i,
    Q(v)_i = r · sgn(v_i) · q_i / s.

E[Q(v)] = v (unbiased) and the per-coordinate variance is (r/s)²·f_i(1-f_i) with f_i = a_i - l_i
(≤ r²/(4s²)); Proposition 1's d/(6s²)·‖v‖_p² holds when the f_i are uniform. p = ∞ is the DQSGD
paper's choice [text, App. F]; p = 2 is QSGD's theory setting [recalled]. Bucketing (one norm per
d' coordinates) follows QSGD's practice [recalled].

Randomness comes only from the explicit ``generator`` (one uniform draw per coordinate, in order),
or, when ``rng`` is given, from ``rng.uniform(n, device)`` instead (e.g. the counter-based
:class:`dqsgd.kernels.HashRNG`, whose uniforms the fused CPU kernels reproduce bit for bit).
"""

from __future__ import annotations

from typing import Protocol

import torch

from dqsgd.quantizers.segments import check_bits, expand, flat_float, require_finite, segment_reduce
from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme, SchemeQuantizer
from dqsgd.quantizers.constants import levels_for_bits

MIN_BITS, MAX_BITS = 2, 16


class UniformSource(Protocol):
    """n float32 uniforms in [0, 1) on a device (a stateless, counter-based stream)."""

    def uniform(self, n: int, device: torch.device | str | None = None) -> torch.Tensor: ...


def quantize_uniform(
    x: torch.Tensor,
    bits: int,
    generator: torch.Generator | None = None,
    *,
    norm: Norm = Norm.MAX,
    layout: Layout = Layout(),
    rng: UniformSource | None = None,
) -> Quantized:
    """Stochastically quantize ``x`` to B bits per coordinate (see the module docstring).

    ``rng`` replaces ``generator`` as the source of the n uniforms (both given: an error).
    """
    if rng is not None and generator is not None:
        raise ValueError("uniform quantizer: pass a generator or an rng, not both")
    check_bits(bits, MIN_BITS, MAX_BITS, "uniform quantizer")
    if norm not in (Norm.MAX, Norm.L2):
        raise ValueError(f"uniform quantizer: norm must be Norm.MAX or Norm.L2, got {norm!r}")
    flat = flat_float(x)
    n = flat.numel()
    s = levels_for_bits(bits)
    scales = segment_reduce(flat, layout, "max_abs" if norm == Norm.MAX else "l2")
    require_finite(scales, "uniform quantizer")
    if n == 0:
        codes = torch.zeros(0, dtype=torch.int32)
        return Quantized(Scheme.UNIFORM, bits, s, codes, scales.cpu(), layout, tuple(x.shape), norm, dtype=x.dtype)
    # Zero segments quantize to all-zero codes: divide by 1 instead of 0 (|v_i| = 0 there anyway).
    inv = torch.where(scales > 0, s / scales, torch.zeros_like(scales))
    if not bool(torch.isfinite(inv).all()):
        # ‖v‖ below s·2^-128 (float32 denormals): s/‖v‖ overflows. The fused kernel refuses too.
        raise ValueError(f"uniform quantizer: a segment norm {float(scales[~torch.isfinite(inv)][0]):.3e} is too small "
                         f"to scale by s = {s} in float32 (below s·2^-128); rescale the input")
    a = flat.abs() * expand(inv, layout, n)
    # float32 rounding can push |g|·s/max to s + ε; clamp so the level never exceeds s (docs/design.md).
    a = a.clamp_(max=float(s))
    low = a.floor()
    if rng is not None:
        u = rng.uniform(n, flat.device)
    else:
        u = torch.rand(n, generator=generator, device=flat.device, dtype=torch.float32)
    q = low + (u < (a - low)).to(torch.float32)
    q = q.clamp_(max=float(s))
    codes = (torch.where(flat < 0, -q, q)).to(torch.int32)
    return Quantized(Scheme.UNIFORM, bits, s, codes.cpu(), scales.cpu(), layout, tuple(x.shape), norm, dtype=x.dtype)


class UniformQuantizer(SchemeQuantizer):
    """The registry entry of stochastic uniform quantization: its width may change every step (the
    bit policies choose it), and the fused kernels of ``dqsgd.kernels`` implement it."""

    name, scheme = "uniform", Scheme.UNIFORM
    dynamic = fused = True

    def bits_error(self, bits: int) -> str | None:
        if MIN_BITS <= bits <= MAX_BITS:
            return None
        return (f"bits must be in [{MIN_BITS}, {MAX_BITS}] for stochastic uniform quantization "
                f"(s = 2^(B-1) - 1 >= 1), got {bits}")

    def quantize(self, x, bits, generator=None, *, layout=Layout(), norm=Norm.MAX, scaled=False, scalers=None,
                 clip=None) -> Quantized:
        return quantize_uniform(x, bits, generator, norm=norm, layout=layout)


UNIFORM = UniformQuantizer()
