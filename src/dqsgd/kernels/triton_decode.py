"""Triton kernels of the FIXED uniform codec's decode: unpack, checks, and ``out += w·(c·step)``
(:mod:`dqsgd.kernels.triton_codec` is the encode; why the sums are the host's bit for bit is said there:
``out + w·(c·step)`` is an FMA pattern, so every launch here passes ``enable_fp_fusion=False``).

:func:`decode_groups` is one program's work on one payload: it checks and unpacks its codes and returns
their terms ``w·(c·step)``; the caller adds them (:func:`_decode_kernel`: into ``out``, one payload;
``triton_batch._decode_batch``: several payloads summed in registers, in their order, then written once).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from dqsgd.kernels.triton_codec import GROUPS, HB, Segments, pow2, segment_span
from dqsgd.quantizers import Layout

__all__ = ["Checks", "STATS", "accumulate_triton", "decode_groups"]


@triton.jit
def _flag(stats_ptr, bad_ptr, value, BAD: tl.constexpr):
    """stats |= value (an int32 scalar); BAD: *bad = True where it is not 0 (never cleared)."""
    tl.atomic_or(stats_ptr, value)
    if BAD:
        tl.store(bad_ptr, value != 0, mask=value != 0)


@triton.jit
def _check_head(pay_ptr, head_ptr, stats_ptr, bad_ptr, k, scale_at, nseg, HB: tl.constexpr, BAD: tl.constexpr):
    """stats[0] |= a byte of this program's HB header bytes differs from the template outside the
    scales; stats[1] |= a scale here is not finite (exponent bits all set: bytes 3 and 2 of a float32)."""
    i = tl.program_id(0).to(tl.int64) * HB + tl.arange(0, HB)
    ok = i < k
    j = i - scale_at
    scale = (j >= 0) & (j < 4 * nseg)
    p = tl.load(pay_ptr + i, mask=ok, other=0).to(tl.int32)
    differs = ok & (scale == 0) & (p != tl.load(head_ptr + i, mask=ok, other=0).to(tl.int32))
    top = ok & scale & (j % 4 == 3)
    below = tl.load(pay_ptr + i - 1, mask=top, other=0).to(tl.int32)
    _flag(stats_ptr, bad_ptr, tl.max(differs.to(tl.int32)), BAD)
    _flag(stats_ptr + 1, bad_ptr, tl.max((top & ((p & 0x7F) == 0x7F) & ((below & 0x80) != 0)).to(tl.int32)), BAD)


@triton.jit(do_not_specialize=["k", "scale_at", "tail", "lo_ok", "hi_ok", "zero_ok"])
def _decode_kernel(body_ptr, step_ptr, starts_ptr, out_ptr, stats_ptr, bad_ptr, pay_ptr, head_ptr, w, n, nbytes, nseg,
                   bucket, k, scale_at, tail, lo_ok, hi_ok, zero_ok, BITS: tl.constexpr, WB: tl.constexpr,
                   GROUPS: tl.constexpr, MODE: tl.constexpr, STEPS: tl.constexpr, WRITE: tl.constexpr,
                   CHECK: tl.constexpr, HB: tl.constexpr, BAD: tl.constexpr):
    """Unpack GROUPS·8 codes; WRITE: out += w·(c·step). CHECK: stats = [header differs, non-finite
    scale, -, padding bits, min c, max c, zero count, a code outside [lo_ok, hi_ok] or a forbidden
    zero, w·(top·step) not finite for a coordinate's step (the finite-output rule,
    :mod:`dqsgd.quantizers.base`; top = max(-lo_ok, hi_ok))] (atomics; the header's k bytes are
    checked by the first ⌈k/HB⌉ programs); BAD: a failed check also sets *bad."""
    term, idx, ok = decode_groups(body_ptr, step_ptr, starts_ptr, stats_ptr, bad_ptr, pay_ptr, head_ptr, w, n, nbytes,
                                  nseg, bucket, k, scale_at, tail, lo_ok, hi_ok, zero_ok, BITS, WB, GROUPS, MODE, STEPS,
                                  CHECK, HB, BAD)
    if WRITE:
        o = tl.load(out_ptr + idx, mask=ok, other=0.0)
        tl.store(out_ptr + idx, o + term, mask=ok)


@triton.jit
def decode_groups(body_ptr, step_ptr, starts_ptr, stats_ptr, bad_ptr, pay_ptr, head_ptr, w, n, nbytes, nseg,
                   bucket, k, scale_at, tail, lo_ok, hi_ok, zero_ok, BITS: tl.constexpr, WB: tl.constexpr,
                   GROUPS: tl.constexpr, MODE: tl.constexpr, STEPS: tl.constexpr, CHECK: tl.constexpr,
                   HB: tl.constexpr, BAD: tl.constexpr):
    """The work of one :func:`_decode_kernel` program on one payload but the add: its checks (CHECK), and
    (terms w·(c·step), their coordinates, which are in the payload) for the caller to add."""
    if CHECK:
        _check_head(pay_ptr, head_ptr, stats_ptr, bad_ptr, k, scale_at, nseg, HB, BAD)
        if tl.program_id(0) == 0:
            last = tl.load(body_ptr + nbytes - 1, mask=tail > 0, other=0).to(tl.int32)
            _flag(stats_ptr + 3, bad_ptr, tl.where(tail > 0, last >> tail, 0), BAD)
    g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    b = tl.arange(0, WB)
    at = g[:, None] * BITS + b[None, :]
    byte = tl.load(body_ptr + at, mask=(b < BITS)[None, :] & (at < nbytes), other=0).to(tl.uint64)
    d = 8 * b - 4 * BITS
    lo = tl.sum(tl.where((d < 0)[None, :], byte << tl.minimum(8 * b, 63).to(tl.uint64)[None, :], 0), axis=1)
    hi_l = byte << tl.maximum(d, 0).to(tl.uint64)[None, :]
    hi_r = byte >> tl.minimum(tl.maximum(-d, 0), 63).to(tl.uint64)[None, :]
    hi = tl.sum(tl.where((d >= 0)[None, :], hi_l, tl.where((d > -8)[None, :], hi_r, 0)), axis=1)
    t = tl.arange(0, 8)
    half = tl.where((t < 4)[None, :], lo[:, None], hi[:, None])
    v = ((half >> ((t % 4) * BITS).to(tl.uint64)[None, :]) & ((1 << BITS) - 1)).to(tl.int32)
    if BITS == 1:
        c = 2 * v - 1
    else:
        c = v - (1 << (BITS - 1))
    idx = g[:, None] * 8 + t[None, :]
    ok = idx < n
    if CHECK:
        tl.atomic_min(stats_ptr + 4, tl.min(tl.where(ok, c, 0x7FFFFFFF)))
        tl.atomic_max(stats_ptr + 5, tl.max(tl.where(ok, c, -0x7FFFFFFF)))
        tl.atomic_add(stats_ptr + 6, tl.sum((ok & (c == 0)).to(tl.int32)))
        outside = ok & ((c < lo_ok) | (c > hi_ok) | ((c == 0) & (zero_ok == 0)))
        _flag(stats_ptr + 7, bad_ptr, tl.max(outside.to(tl.int32)), BAD)
    st = tl.load(step_ptr + segment_span(idx, ok, starts_ptr, nseg, bucket, MODE, STEPS), mask=ok, other=0.0)
    if CHECK:
        top = tl.maximum(-lo_ok, hi_ok).to(tl.float32)
        over = ok & (tl.abs(w * (top * st)) > 3.4028234663852886e38)
        _flag(stats_ptr + 8, bad_ptr, tl.max(over.to(tl.int32)), BAD)
    return w * (c.to(tl.float32) * st), idx, ok



# ------------------------------------------------------------------------------------ host side


STATS = 9  # [header differs, non-finite scale, crc mismatch, padding bits, min c, max c, zeros, code out of range,
#             values not finite]


@dataclass(frozen=True)
class Checks:
    """What the decode kernel checks besides the codes: the header's first ``k`` bytes of ``payload``
    against ``head`` outside the scales (k = 0: none), the scales' finiteness, the padding bits, and
    the codes against [lo, hi] (zero codes allowed or not); results go to ``stats`` (int32, STATS of
    them, started by the crc's last level: ``triton_crc.crc32_triton(..., stats=)``), and a failure
    sets ``bad`` (a 0-dim bool, never cleared) if it is given."""
    stats: torch.Tensor
    bad: torch.Tensor | None
    payload: torch.Tensor
    head: torch.Tensor
    k: int
    scale_at: int
    nseg: int
    lo: int
    hi: int
    zero_ok: bool


def accumulate_triton(body: torch.Tensor, steps: torch.Tensor, layout: Layout, weight: float, bits: int, n: int,
                      out: torch.Tensor, write: bool, checks: Checks | None) -> None:
    """With ``write``: ``out += weight·(c·step)`` for the n codes of a FIXED body (out: contiguous
    float32 of n elements); with ``checks``: the checks of :class:`Checks` into its stats."""
    dev = body.device
    grid = triton.cdiv(triton.cdiv(n, 8), GROUPS)
    if checks is not None:
        grid = max(grid, triton.cdiv(checks.k, HB), 1)
    if not grid:
        return
    c = checks or Checks(steps, None, body, body, 0, 0, 0, 0, 0, True)  # unused pointers and sizes
    seg = Segments(layout, n, dev)
    _decode_kernel[(grid,)](body, steps, seg.starts, out, c.stats, c.stats if c.bad is None else c.bad, c.payload,
                            c.head, float(np.float32(weight)), n, body.numel(), seg.nseg, seg.bucket, c.k, c.scale_at,
                            (n * bits) % 8, c.lo, c.hi, int(c.zero_ok), BITS=bits, WB=pow2(bits), GROUPS=GROUPS,
                            WRITE=write, CHECK=checks is not None, HB=HB, BAD=c.bad is not None,
                            enable_fp_fusion=False, **seg.meta())
