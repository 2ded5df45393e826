"""Triton kernels of the FIXED uniform codec's encode: max norm, header + quantize + pack (the decode:
:mod:`dqsgd.kernels.triton_decode`).

:mod:`dqsgd.kernels.device` and :mod:`dqsgd.kernels.device_decode` call them (when
:func:`dqsgd.kernels.device_common.use_triton` says so). The per-call work is in the kernels too, so
that a call issues few launches (the host's issue time, not the kernels, bounded a call below ~25M
elements): the encode kernel writes the header (the template's bytes, the scales, a NaN scale where
s/r is not finite, the refusal flags), the decode kernel checks the header bytes, the scales, the
padding and the codes. The crc is :mod:`dqsgd.kernels.triton_crc` (its last level compares a
decoded payload's crc and starts the flags). The encode reads the HashRNG key from a device tensor
(:func:`dqsgd.kernels.workspace.step_key`), not a kernel argument: two steps launch the same
arguments, so a CUDA graph captured once replays at every step.

Why the bytes equal the numba kernels' (:mod:`dqsgd.kernels.fused`) for the same input and key:

* **Uniforms.** u_i is field (i mod 4) of h_⌊i/4⌋ = mix64(key + (⌊i/4⌋ + 1)·γ) in uint64 arithmetic
  (wrapping multiply and add, logical shifts: the same bits on every backend), then
  (field + 1/2)·2^-16 in float32: exact.
* **Max norm.** An integer maximum of the float32 bit patterns with the sign cleared: exact in any
  order (atomics included), and NaN/Inf lie above every finite pattern, so a non-finite input gives
  a non-finite scale (refused as the host refuses it). float16/bfloat16 inputs are widened to
  float32 in the kernel (exact), as ``flat_float`` widens them for the host.
* **l2 norm and s/r.** The l2 norm is the host's own torch expression (a float reduction's bits
  depend on its order). ``1/r`` is torch's correctly rounded reciprocal, passed in (Triton's float32
  ``/`` is not correctly rounded on CUDA); the kernel forms where(r > 0, (1/r)·s, 0), which is
  torch's ``levels / r`` (``r.reciprocal()·levels``), what the numba kernel computes. The decode's
  ``r/levels`` is likewise a torch division, passed in.
* **Rounding.** float32 in the numba kernel's order: a = min(|x|·inv, s), ⌊a⌋ + [u < a − ⌊a⌋]
  clamped to s, the sign of x; one bit: [u < (clamp(x·inv, −1, 1) + 1)·½]. No product feeds an
  addition directly there, so no FMA can form.
* **Decode.** ``out + w·(c·step)`` *is* an FMA pattern: the kernel is launched with
  ``enable_fp_fusion=False`` (two roundings, as numba's non-fast-math loop), so the sum is the
  host's bit for bit. The CPU interpreter (what CI runs) evaluates with numpy and never fuses;
  on a GPU the same tests run natively.
* **Packing.** Eight w-bit values fill w bytes; a group is held as two uint64 halves (values 0..3
  and 4..7, 4·w ≤ 64 bits each) and byte b is cut from them as in :mod:`dqsgd.kernels.device_pack`.

Each program handles ``GROUPS`` groups of 8 values (1024 coordinates). Kernel arguments carry no
type hints: Triton reads a parameter's annotation as its type. Segments: one, buckets
(index // bucket) or explicit sizes (a branch-free binary search in the segment starts, no
n-sized index tensor).
"""

from __future__ import annotations


import numpy as np
import torch
import triton
import triton.language as tl

from dqsgd.kernels.triton_crc import block_table_on, crc_scatter, level0_blocks
from dqsgd.kernels.workspace import scratch
from dqsgd.quantizers import Layout

__all__ = ["Segments", "absmax_triton", "encode_triton"]

GROUPS = 128  # groups of 8 coordinates per program
BLOCK = 4096  # coordinates per program of the norm kernel (one atomic each, in one segment)
HB = 1024  # header bytes per program
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


@triton.jit
def segment_span(idx, ok, starts_ptr, nseg, bucket, MODE: tl.constexpr, STEPS: tl.constexpr):
    """The segment of each coordinate: 0 (MODE 0), idx // bucket (MODE 1), or the last k with
    starts[k] ≤ idx (MODE 2, STEPS halvings of [0, nseg − 1]: empty segments are skipped)."""
    if MODE == 0:
        return tl.zeros_like(idx)
    elif MODE == 1:
        return idx // bucket
    else:
        lo = tl.zeros_like(idx)
        hi = tl.zeros_like(idx) + (nseg - 1)
        for _ in tl.static_range(STEPS):
            mid = (lo + hi + 1) // 2
            below = tl.load(starts_ptr + mid, mask=ok, other=0) <= idx
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid - 1)
        return lo


@triton.jit
def _absmax_kernel(x_ptr, out_ptr, starts_ptr, n, nseg, bucket, BLOCK: tl.constexpr, MODE: tl.constexpr,
                   STEPS: tl.constexpr):
    """out[k] = max of (float32 bits of x with the sign cleared) over segment k (out starts at 0):
    one segment, or explicit sizes (a block inside one segment takes one atomic, else one per coordinate)."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    x = tl.load(x_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    seg = segment_span(idx, ok, starts_ptr, nseg, bucket, MODE, STEPS)
    first = tl.min(tl.where(ok, seg, nseg), axis=0)
    last = tl.max(tl.where(ok, seg, -1), axis=0)
    if first == last:  # the whole block in one segment: one atomic
        tl.atomic_max(out_ptr + first, tl.max(bits, axis=0))
    else:
        tl.atomic_max(out_ptr + seg, bits, mask=ok)


@triton.jit
def _absmax_bucket_kernel(x_ptr, out_ptr, n, bucket, chunks, SB: tl.constexpr):
    """Bucket layouts: program p covers chunk p % chunks (SB coordinates) of bucket p // chunks, so
    every program is inside one segment: one atomic each, whatever the bucket size."""
    p = tl.program_id(0).to(tl.int64)
    seg, c = p // chunks, p % chunks
    at = c * SB + tl.arange(0, SB)
    idx = seg * bucket + at
    ok = (at < bucket) & (idx < n)
    x = tl.load(x_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    tl.atomic_max(out_ptr + seg, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0))


@triton.jit
def mix64_triton(z):
    """SplitMix64's finalizer on uint64 values (:func:`dqsgd.kernels.hashrng.mix64`)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _or_halves(v, GROUPS: tl.constexpr):
    """(lo, hi) of (GROUPS, 8) disjoint-bit uint64 fields: OR of values 0..3 and of values 4..7."""
    a, b = tl.split(tl.reshape(v, (GROUPS, 2, 2, 2)))
    a, b = tl.split(a | b)
    return tl.split(a | b)


@triton.jit
def _inverse(r, rec, LEVELS: tl.constexpr):
    """inv = s/r where r > 0, else 0: ``rec`` = 1/r is torch's correctly rounded reciprocal (the host's
    ``levels / r`` is ``r.reciprocal()·levels``); the product by s rounds as torch's."""
    return tl.where(r > 0, rec * LEVELS, 0.0)


@triton.jit
def write_head(head_ptr, scale_ptr, rec_ptr, out_ptr, flag_ptr, k, scale_at, nseg, LEVELS: tl.constexpr,
                HB: tl.constexpr, FLAGS: tl.constexpr):
    """This program's HB bytes of the header (bytes 0..k): the template's bytes, and in the scales'
    place the float32 scales r (torch's NaN where inv is not finite). FLAGS: flags |= [r non-finite,
    inv non-finite] (atomics). Returns (bytes, their positions, which are written) for the crc."""
    i = tl.program_id(0).to(tl.int64) * HB + tl.arange(0, HB)
    j = i - scale_at
    scale = (i < k) & (j >= 0) & (j < 4 * nseg)
    seg = tl.where(scale, j // 4, 0)
    r = tl.load(scale_ptr + seg, mask=scale, other=0.0)
    inv = _inverse(r, tl.load(rec_ptr + seg, mask=scale, other=0.0), LEVELS)
    inv_bad = (inv.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000
    rb = tl.where(inv_bad, 0x7FC00000, r.to(tl.int32, bitcast=True))
    byte = tl.where(scale, (rb >> (8 * (j % 4))) & 0xFF, tl.load(head_ptr + i, mask=i < k, other=0))
    tl.store(out_ptr + i, byte.to(tl.uint8), mask=i < k)
    if FLAGS:
        first = scale & (j % 4 == 0)
        r_bad = (r.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000
        tl.atomic_or(flag_ptr, tl.max((first & r_bad).to(tl.int32)))
        tl.atomic_or(flag_ptr + 1, tl.max((first & inv_bad).to(tl.int32)))
    return byte.to(tl.int32), i, i < k


@triton.jit(do_not_specialize=["k", "scale_at", "pad", "raw_at"])  # sizes vary by shape: no variant per value
def _encode_kernel(x_ptr, scale_ptr, rec_ptr, starts_ptr, out_ptr, head_ptr, flag_ptr, tab_ptr, raw_ptr, raw_at, key_ptr,
                   n, nbytes, nseg, bucket, k, scale_at, pad, BITS: tl.constexpr, LEVELS: tl.constexpr,
                   WB: tl.constexpr, GROUPS: tl.constexpr, MODE: tl.constexpr, STEPS: tl.constexpr, HB: tl.constexpr,
                   FLAGS: tl.constexpr, BLOG: tl.constexpr):
    """The header's bytes of this program (:func:`write_head`), then stochastic rounding of GROUPS·8
    coordinates and their FIXED packing into the body (nbytes from ``out_ptr + k``); and level 0 of
    the crc of the bytes it wrote, XORed into ``raw_ptr`` (``triton_crc.crc_scatter``; ``pad``: the
    stream's front padding), so the crc reads no payload byte again. The key's int64 bits are read from
    ``key_ptr``."""
    encode_program(x_ptr, scale_ptr, rec_ptr, starts_ptr, out_ptr, head_ptr, flag_ptr, tab_ptr, raw_ptr + raw_at,
                   tl.load(key_ptr).to(tl.uint64, bitcast=True), n, nbytes, nseg, bucket, k, scale_at, pad, BITS, LEVELS,
                   WB, GROUPS, MODE, STEPS, HB, FLAGS, BLOG)


@triton.jit
def encode_program(x_ptr, scale_ptr, rec_ptr, starts_ptr, out_ptr, head_ptr, flag_ptr, tab_ptr, raw_ptr, key, n,
                   nbytes, nseg, bucket, k, scale_at, pad, BITS: tl.constexpr, LEVELS: tl.constexpr, WB: tl.constexpr,
                   GROUPS: tl.constexpr, MODE: tl.constexpr, STEPS: tl.constexpr, HB: tl.constexpr,
                   FLAGS: tl.constexpr, BLOG: tl.constexpr):
    """The work of one :func:`_encode_kernel` program on one payload (``key``: uint64)."""
    hv, hs, hok = write_head(head_ptr, scale_ptr, rec_ptr, out_ptr, flag_ptr, k, scale_at, nseg, LEVELS, HB, FLAGS)
    crc_scatter(hv, hs, hok, tab_ptr, raw_ptr, pad, HB, 10)
    bv, bs, bok = encode_groups(x_ptr, scale_ptr, rec_ptr, starts_ptr, out_ptr + k, key, n, nbytes, nseg, bucket, BITS,
                                LEVELS, WB, GROUPS, MODE, STEPS)
    crc_scatter(bv, bs + k, bok, tab_ptr, raw_ptr, pad, GROUPS * WB, BLOG)


@triton.jit
def encode_groups(x_ptr, scale_ptr, rec_ptr, starts_ptr, body_ptr, key, n, nbytes, nseg, bucket, BITS: tl.constexpr,
                   LEVELS: tl.constexpr, WB: tl.constexpr, GROUPS: tl.constexpr, MODE: tl.constexpr,
                   STEPS: tl.constexpr):
    """Stochastic rounding of this program's GROUPS·8 coordinates (``key``: uint64) and their FIXED
    packing into the body at ``body_ptr`` (nbytes). Returns (bytes, their offsets in the body, which
    are written) for the crc."""
    g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    t = tl.arange(0, 8)
    idx = g[:, None] * 8 + t[None, :]
    ok = idx < n
    x = tl.load(x_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    seg = segment_span(idx, ok, starts_ptr, nseg, bucket, MODE, STEPS)
    inv = _inverse(tl.load(scale_ptr + seg, mask=ok, other=0.0), tl.load(rec_ptr + seg, mask=ok, other=0.0), LEVELS)
    j = (g[:, None] * 2 + tl.arange(0, 2)[None, :] + 1).to(tl.uint64)  # one hash per 4 coordinates
    h = mix64_triton(key + j * 0x9E3779B97F4A7C15)
    k16 = (tl.arange(0, 4) * 16).to(tl.uint64)
    field = tl.reshape((h[:, :, None] >> k16[None, None, :]) & 0xFFFF, (GROUPS, 8))
    u = (field.to(tl.float32) + 0.5) * 1.52587890625e-05  # 2^-16
    if BITS == 1:
        v = tl.minimum(tl.maximum(x * inv, -1.0), 1.0)
        val = (u < (v + 1.0) * 0.5).to(tl.uint64)
    else:
        sf = LEVELS * 1.0
        a = tl.minimum(tl.abs(x) * inv, sf)
        low = tl.floor(a)
        q = tl.minimum(low + (u < a - low).to(tl.float32), sf).to(tl.int32)
        val = (tl.where(x < 0, -q, q) + (1 << (BITS - 1))).to(tl.uint64)
    val = tl.where(ok, val, 0) << ((t % 4) * BITS).to(tl.uint64)[None, :]
    lo, hi = _or_halves(val, GROUPS)
    b = tl.arange(0, WB)
    d = 8 * b - 4 * BITS  # where byte b starts relative to hi
    from_lo = lo[:, None] >> tl.minimum(8 * b, 63).to(tl.uint64)[None, :]
    hi_r = hi[:, None] >> tl.maximum(d, 0).to(tl.uint64)[None, :]
    hi_l = hi[:, None] << tl.minimum(tl.maximum(-d, 0), 63).to(tl.uint64)[None, :]
    straddle = ((d > -8) & (d < 0))[None, :]
    byte = tl.where((d < 0)[None, :], from_lo | tl.where(straddle, hi_l, 0), hi_r) & 0xFF
    at = g[:, None] * BITS + b[None, :]
    ok = (b < BITS)[None, :] & (at < nbytes)
    tl.store(body_ptr + at, byte.to(tl.uint8), mask=ok)
    return byte.to(tl.int32), at, ok


# ------------------------------------------------------------------------------------ host side


class Segments:
    """How a kernel finds a coordinate's segment: (MODE, STEPS, starts tensor, nseg, bucket)."""

    def __init__(self, layout: Layout, n: int, device: torch.device) -> None:
        self.nseg, self.bucket, self.steps = layout.num_segments(n), 1, 1
        self.starts = _starts_on((), device)  # [0]: unused outside MODE 2
        if layout.sizes is not None:
            self.mode, self.steps = 2, max(self.nseg - 1, 1).bit_length()
            self.starts = _starts_on(tuple(layout.sizes), device)
        elif 0 < layout.bucket < n:
            self.mode, self.bucket = 1, layout.bucket
        else:
            self.mode = 0

    def args(self) -> tuple:
        return self.starts, self.nseg, self.bucket

    def meta(self) -> dict:
        return {"MODE": self.mode, "STEPS": self.steps}


_STARTS: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}


def _starts_on(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    key = (sizes, str(device))
    if key not in _STARTS:
        if len(_STARTS) > 64:
            _STARTS.clear()
        starts = np.concatenate(([0], np.cumsum(np.asarray(sizes, dtype=np.int64))))
        _STARTS[key] = torch.from_numpy(starts).to(device)
    return _STARTS[key]


def pow2(w: int) -> int:
    return 1 << (w - 1).bit_length()


def absmax_triton(flat: torch.Tensor, layout: Layout, nseg: int) -> torch.Tensor:
    """max |x| per segment (float32, ``nseg`` of them) of a contiguous 1-D float tensor."""
    return absmax_bits_triton(flat, layout, nseg).view(torch.float32)


def absmax_bits_triton(flat: torch.Tensor, layout: Layout, nseg: int, extra: int = 0) -> torch.Tensor:
    """The float32 bits (int32) of :func:`absmax_triton`'s norms, followed in the same buffer by
    ``extra`` zeros (the crc's level-0 raws: one zero fill for both)."""
    n = flat.numel()
    bits = scratch("absmax1", nseg + extra, torch.int32, flat.device, zero=True)
    if not n:
        return bits
    seg = Segments(layout, n, flat.device)
    if seg.mode == 1:
        sb = min(BLOCK, pow2(seg.bucket))
        chunks = triton.cdiv(seg.bucket, sb)
        _absmax_bucket_kernel[(seg.nseg * chunks,)](flat, bits, n, seg.bucket, chunks, SB=sb)
    else:
        _absmax_kernel[(triton.cdiv(n, BLOCK),)](flat, bits, seg.starts, n, seg.nseg, seg.bucket, BLOCK=BLOCK,
                                                 **seg.meta())
    return bits


def encode_triton(flat: torch.Tensor, scales: torch.Tensor, layout: Layout, key: torch.Tensor, bits: int, levels: int,
                  head: torch.Tensor, scale_at: int, payload: torch.Tensor, flags: bool,
                  raws: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor | None, tuple[torch.Tensor, int]]:
    """Write the header and the FIXED body of ``flat`` (contiguous, 1-D, float32/16/bf16) at ``bits``
    into ``payload`` (uint8: ``head``'s k bytes, then ⌈n·bits/8⌉, then the crc's 4, not written here).
    ``head``: the template's header bytes on the device, the float32 ``scales`` (contiguous, one per
    segment) go in at ``scale_at``; ``key``: a 1-element int64 tensor on the device holding the HashRNG
    key's bits (:func:`dqsgd.kernels.workspace.step_key`), read by the kernel. ``inv = s/r`` per segment
    uses torch's correctly rounded ``1/r`` (Triton's float32 division is not correctly rounded on
    CUDA). Returns ([r non-finite, inv non-finite] (int32 on the device) if ``flags``, the crc's
    level-0 raws of ``payload[:-4]`` for ``triton_crc.crc32_triton(..., level0=)``); ``raws = (buf,
    at)``: a zeroed int32 buffer with ``level0_blocks(len(payload) - 4)[0]`` elements for them from
    ``at`` on (else one is made). The kernel reads ``scales[:nseg]`` only (``scales`` may go on)."""
    n, k, dev = flat.numel(), head.numel(), flat.device
    fl = torch.zeros(2, dtype=torch.int32, device=dev) if flags else scales
    blocks, pad = level0_blocks(payload.numel() - 4)
    raws = (scratch("crc0", blocks, torch.int32, dev, zero=True), 0) if raws is None else raws
    seg = Segments(layout, n, dev)
    grid = (max(triton.cdiv(triton.cdiv(n, 8), GROUPS), triton.cdiv(k, HB)),)
    rec = torch.reciprocal(scales, out=scratch("rec1", scales.numel(), torch.float32, dev))
    _encode_kernel[grid](flat, scales, rec, seg.starts, payload, head, fl, block_table_on(dev), *raws, key, n,
                         payload.numel() - k - 4, seg.nseg, seg.bucket, k, scale_at, pad, BITS=bits, LEVELS=levels,
                         WB=pow2(bits), GROUPS=GROUPS, HB=HB, FLAGS=flags, BLOG=body_log(bits), **seg.meta())
    return (fl if flags else None), raws


def body_log(bits: int) -> int:
    """log2 of the (GROUPS, WB) byte tile an encode program packs (``crc_scatter``'s SIZE)."""
    return (GROUPS * pow2(bits)).bit_length() - 1
