"""The fused uniform quantizer with uniforms the caller gives: round-to-nearest (u = ½ for every
coordinate) or a ``torch.Generator``'s ``torch.rand`` draws, packed straight into a FIXED payload.

:func:`encode_rounded` returns ``encode(quantize_uniform(x, bits, generator, layout=layout), FIXED)``
— or with ``rng`` a source of constant ½ (round-to-nearest: a level fraction f goes up exactly when
f > ½) — byte for byte, in the two passes of :mod:`dqsgd.kernels.fused` (max norm per segment;
round and pack per chunk of ``CHUNK`` coordinates in L1), instead of quantize_uniform's dozen
full-size torch temporaries and the codec's separate packing and range passes. The arithmetic is
quantize_uniform's, in float32 and in its order (``a = min(|x|·inv, s)``, ``low = ⌊a⌋``,
``q = min(low + [u < a − low], s)``, the sign of x), with inv = s/norm as
:func:`~dqsgd.kernels.codec.inverse_norms` computes it, so every code is the same. The header,
scales and crc are :class:`~dqsgd.kernels.codec.FixedPlan`'s, which also decodes such payloads.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from dqsgd.codecs.threads import crc32, run_split
from dqsgd.kernels.codec import MIN_CHUNKS_PER_THREAD, fixed_plan, inverse_norms, max_norms
from dqsgd.kernels.fused import CHUNK, pack_chunk
from dqsgd.quantizers import Layout, Norm, NonFiniteGradientError

__all__ = ["NEAREST", "encode_rounded"]

NEAREST = np.full(1, 0.5, dtype=np.float32)  # the one uniform of round-to-nearest


@njit(cache=True, inline="always")
def _round_piece(x, i0, t0, t1, inv, sf, u, cbuf):  # pragma: no cover - compiled
    """cbuf[t] for t in [t0, t1): the code of x[i0 + t] with uniform u[i0 + t] (u of one element:
    that uniform for every coordinate). Slices from 0, float32 throughout: see fused._quantize_piece."""
    xs, cs = x[i0 + t0 : i0 + t1], cbuf[t0:t1]
    if u.size == 1:
        h = u[0]
        for t in range(xs.size):
            v = xs[t]
            a = min(abs(v) * inv, sf)
            low = np.floor(a)
            q = min(low + np.float32(h < a - low), sf)
            cs[t] = np.int32(-q if v < 0 else q)
    else:
        us = u[i0 + t0 : i0 + t1]
        for t in range(xs.size):
            v = xs[t]
            a = min(abs(v) * inv, sf)
            low = np.floor(a)
            q = min(low + np.float32(us[t] < a - low), sf)
            cs[t] = np.int32(-q if v < 0 else q)


@njit(cache=True, nogil=True)
def encode_rounded_range(x, starts, inv, sf, u, width, offset, out, c_lo, c_hi):  # pragma: no cover - compiled
    """Quantize chunks [c_lo, c_hi) of ``x`` with the uniforms ``u`` and pack them at ``width``
    (offset binary) into the body ``out``."""
    n = x.size
    cbuf = np.empty(CHUNK, np.int32)
    seg = np.searchsorted(starts, c_lo * CHUNK, side="right") - 1
    for c in range(c_lo, c_hi):
        i0 = c * CHUNK
        m = min(CHUNK, n - i0)
        t = 0
        while t < m:
            while starts[seg + 1] <= i0 + t:  # also skips empty segments
                seg += 1
            t1 = min(m, starts[seg + 1] - i0)
            _round_piece(x, i0, t, t1, inv[seg], sf, u, cbuf)
            t = t1
        pack_chunk(cbuf, m, i0, width, offset, out)


def encode_rounded(x: torch.Tensor, bits: int, layout: Layout, uniforms: np.ndarray = NEAREST) -> bytes:
    """The FIXED max-norm payload of ``x`` (a float32 CPU tensor, read flat; shape ``(numel,)``) at
    ``bits`` (2..16) with ``layout``'s segments, rounded with ``uniforms`` (float32: one per
    coordinate, or :data:`NEAREST`). See the module docstring for what it equals.

    Raises:
      NonFiniteGradientError: ``x`` holds NaN or Inf (nothing is encoded).
      ValueError: bits outside 2..16, a bad layout, a wrong ``x`` or ``uniforms``, or a norm so small
        that s/norm overflows float32 (quantize_uniform refuses it too).
    """
    if not 2 <= bits <= 16:
        raise ValueError(f"rounded uniform quantizer: bits must be in [2, 16], got {bits}")
    plan = fixed_plan(x.numel(), bits, Norm.MAX, layout)
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"rounded uniform quantizer: x must be a float32 CPU tensor, got {x.dtype} on {x.device}")
    flat = x.detach().reshape(-1).contiguous()
    if uniforms.dtype != np.float32 or uniforms.shape not in ((1,), (plan.numel,)):
        raise ValueError(f"uniforms must be float32, one or {plan.numel} of them; got {uniforms.dtype} "
                         f"{uniforms.shape}")
    out = np.empty(plan.size, dtype=np.uint8)
    head = plan.head_len
    out[:head] = plan.template
    if plan.numel:
        scales = max_norms(flat, plan.starts)
        try:
            inv = inverse_norms(scales, plan.levels)
        except NonFiniteGradientError:
            raise NonFiniteGradientError("rounded uniform quantizer: input contains NaN or Inf; refusing to "
                                         "quantize") from None
        out[plan.scales_at : head - 4] = scales.view(np.uint8)
        run_split(encode_rounded_range, -(-plan.numel // CHUNK), flat.numpy(), plan.starts, inv,
                  np.float32(plan.levels), uniforms, bits, 1 << (bits - 1), out[head : head + plan.body_len],
                  min_per_thread=MIN_CHUNKS_PER_THREAD)
    out[-4:] = np.array([crc32(out[:-4])], dtype="<u4").view(np.uint8)
    return out.tobytes()
