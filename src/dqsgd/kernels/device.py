"""The uniform quantizer's codec in torch ops, on whatever device the tensor lives on.

* :func:`encode_uniform_device` — gradient → FIXED-coding payload as a ``uint8`` tensor on
  ``x.device``, byte for byte the payload of ``encode_uniform_fast(..., coding=Coding.FIXED)``.
* :func:`decode_accumulate_device` — payload tensor → ``out += w·x̂`` on the payload's device,
  bit-identical to :func:`dqsgd.kernels.decode_accumulate`, validating like it.
* :func:`decode_device` — payload tensor → x̂ (float32, the payload's shape) on its device.

Why the bytes match the host kernel. The uniforms are the same SplitMix64 counter hash
(:func:`dqsgd.kernels.hashrng.hash_uniform_torch`: wrapping int64 = uint64 bits). Max norms are
taken as integer maxima of the float bit patterns with the sign cleared (exact in any order, and
NaN/Inf land above every finite value, as in the host kernel); l2 norms use the host's own torch
expression (bitwise on CPU; on another device the summation order may differ in the last bit).
``inv = s/r`` is the host's expression, evaluated eagerly on the (small) per-segment tensor;
rounding is float32 in the host kernel's order; packing is ``device_pack``; the crc is zlib's
(``device_crc``). Decoding computes ``step = r/levels`` with a tensor divisor (correctly rounded
on every backend; a CUDA division by a host scalar becomes a multiplication by its reciprocal)
and ``w·(c·step)`` in a kernel, then adds it to ``out`` in a separate eager ``add_``: a compiler
that contracted ``out + w·(c·step)`` into an FMA would round once instead of twice.

Header. It depends only on (shape, bits, norm, layout): a host template is written once per key by
``write_header`` with two different placeholder scales; the bytes that differ are the scales'
place (so nothing here hard-codes header offsets), and the device-computed float32 scales are
spliced in there as bytes.

Kernels. On CUDA, where Triton is installed (the ``gpu`` extra), the n-sized passes (max norm,
quantize + pack, the crc, and decoding) are the Triton kernels of :mod:`dqsgd.kernels.triton_codec`:
one pass per stage, same bytes; there the header, the refusal flags and the decode's checks are
written by the kernels too (few launches per call), the l2 norms and the correctly rounded
divisions stay torch ops. Without Triton (or with ``set_triton(False)``) the
torch ops below run under ``torch.compile(dynamic=False)`` on CUDA (inductor fuses the hash,
rounding and packing of each element into one pass); :func:`dqsgd.kernels.device_common.use_triton`
is the one place that decides, and warns once when CUDA runs without Triton. On CPU the eager ops
run by default (the numba kernels are the CPU fast path); :func:`set_compile` forces either. GPU
speed: not measured here (``dqsgd bench gpu`` measures it).

What costs a host sync: see :func:`encode_uniform_device` and :func:`decode_accumulate_device`.
"""

from __future__ import annotations

import torch

from dqsgd.codecs import wire  # its validators, so both paths accept and refuse the same payloads
from dqsgd.kernels.device_common import (
    Template, expected_header, head_on, kernel, per_element, seg_ids_of, set_compile, set_triton, template,
    use_triton,
)
from dqsgd.kernels.device_crc import crc32_length_constant, crc32_with, crc_tables
from dqsgd.kernels.device_decode import decode_accumulate_device, decode_device
from dqsgd.kernels.device_pack import pack_device
from dqsgd.kernels.hashrng import HashRNG, hash_uniform_torch
from dqsgd.kernels.workspace import step_key
from dqsgd.quantizers import Layout, Norm, NonFiniteGradientError, levels_for_bits
from dqsgd.quantizers.segments import check_bits, flat_float, segment_reduce

__all__ = ["decode_accumulate_device", "decode_device", "encode_uniform_device", "expected_header", "set_compile",
           "set_triton"]

_CHECKS = ("sync", "defer")
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # read as they are by the Triton kernels

# ------------------------------------------------------------------------------ encode


def _absmax(flat: torch.Tensor, seg_ids: torch.Tensor | None, bucket: int, nseg: int) -> torch.Tensor:
    """max |x| per segment as the integer max of the bit patterns with the sign cleared (exact in any
    order; NaN and Inf, which lie above every finite pattern, come out as non-finite scales)."""
    bits = flat.view(torch.int32) & 0x7FFFFFFF
    if seg_ids is not None:
        m = torch.zeros(nseg, dtype=torch.int32, device=flat.device)
        m = m.scatter_reduce(0, seg_ids, bits, "amax", include_self=True)
    elif nseg > 1:
        m = torch.nn.functional.pad(bits, (0, nseg * bucket - bits.numel())).view(nseg, bucket).amax(dim=1)
    elif nseg == 1:
        m = bits.amax().reshape(1)
    else:
        m = torch.zeros(0, dtype=torch.int32, device=flat.device)
    return m.view(torch.float32)




def _quantize_pack(flat: torch.Tensor, inv: torch.Tensor, seg_ids: torch.Tensor | None, key: torch.Tensor,
                   bits: int, levels: int, bucket: int) -> torch.Tensor:
    """The FIXED body: stochastic rounding with the hash uniforms, offset binary, packed.

    B ≥ 2: a = min(|x|·inv, s), code = ±min(⌊a⌋ + [u < a − ⌊a⌋], s) (the sign of x), packed as
    code + 2^(B−1). B = 1: bit = [u < (clamp(x·inv, −1, 1) + 1)/2] (code +1 for bit 1, −1 for 0).
    Float32 in the host kernel's order, so every code is the same."""
    n = flat.numel()
    inv_el = per_element(inv, seg_ids, bucket, n)
    u = hash_uniform_torch(key, n)
    if bits == 1:
        val = u < ((flat * inv_el).clamp(-1.0, 1.0) + 1.0) * 0.5
    else:
        sf = float(levels)
        a = (flat.abs() * inv_el).clamp(max=sf)
        low = a.floor()
        q = (low + (u < a - low).to(torch.float32)).clamp(max=sf).to(torch.int32)
        val = torch.where(flat < 0, -q, q) + (1 << (bits - 1))
    return pack_device(val, bits)


def _crc_bytes(data: torch.Tensor, tabs: torch.Tensor, constant: int) -> torch.Tensor:
    """zlib.crc32(data) as 4 little-endian uint8 on data's device (``device_crc``)."""
    crc = crc32_with(data, tabs, constant)
    return ((crc >> torch.arange(0, 32, 8, device=data.device)) & 0xFF).to(torch.uint8)


def device_scales(x: torch.Tensor, norm: Norm, layout: Layout, nseg: int, tri: bool) -> torch.Tensor:
    """Per-segment norms of the flat input ``x`` (any float dtype; float32 on the torch-ops path)."""
    if norm == Norm.L2:  # the host kernel's own expression (summation order matters for the bits)
        return segment_reduce(x.to(torch.float32), layout, "l2").to(torch.float32)
    if tri:
        from dqsgd.kernels.triton_codec import absmax_triton

        return absmax_triton(x, layout, nseg)
    bucket = layout.bucket if layout.sizes is None else 0
    return kernel(_absmax, x.device)(x, seg_ids_of(layout, x.device), bucket, nseg)


def _inverse(scales: torch.Tensor, levels: int) -> torch.Tensor:
    """inv = s/r per segment (0 where r = 0): the host's expression (``levels / r`` is torch's
    correctly rounded ``r.reciprocal()`` times ``levels``)."""
    return torch.where(scales > 0, levels / scales, torch.zeros_like(scales))


def _refuse(scales: torch.Tensor, inv: torch.Tensor, levels: int) -> None:
    """The host kernel's refusals, read with one small sync."""
    nonfinite, overflow = torch.stack([~torch.isfinite(scales).all(), ~torch.isfinite(inv).all()]).tolist()
    if nonfinite:
        raise NonFiniteGradientError(
            f"device uniform quantizer: input contains NaN or Inf (non-finite norm {scales[:4].tolist()}); "
            "refusing to quantize")
    if overflow:
        r = float(scales[~torch.isfinite(inv)][0])
        raise ValueError(f"device uniform quantizer: a segment norm of {r:.3g} is too small: s/norm = {levels}/{r:.3g} "
                         "overflows float32 (norms must be 0 or above s·2^-128)")


def _encode_triton(flat: torch.Tensor, norm: Norm, tpl: Template, layout: Layout, key: torch.Tensor, bits: int,
                   levels: int, check: str) -> torch.Tensor:
    """The payload by the Triton kernels: the norm (its zero fill also zeroes the crc's level-0 raws),
    header and body (with the refusal flags and the crc's level 0 of the bytes written) in one, then
    the crc's levels above."""
    from dqsgd.kernels.triton_codec import absmax_bits_triton, encode_triton
    from dqsgd.kernels.triton_crc import crc32_triton, level0_blocks

    size = len(tpl.head) + tpl.body_len
    raws = None
    if norm == Norm.MAX:  # the scales, then the crc's level-0 raws: one buffer, one zero fill, no slicing
        bits_ = absmax_bits_triton(flat, layout, tpl.nseg, extra=level0_blocks(size)[0])
        scales, raws = bits_.view(torch.float32), (bits_, tpl.nseg)
    else:
        scales = device_scales(flat, norm, layout, tpl.nseg, True).contiguous()
    payload = torch.empty(size + 4, dtype=torch.uint8, device=flat.device)
    flags, raws = encode_triton(flat, scales, layout, key, bits, levels, head_on(tpl, flat.device)[0],
                                tpl.scale_at, payload, check == "sync", raws)
    if flags is not None and any(flags.tolist()):  # the one sync; the messages are worked out only here
        scales = scales[: tpl.nseg]
        _refuse(scales, _inverse(scales, levels), levels)
    crc32_triton(payload[:-4], payload[-4:], level0=raws)
    return payload


def encode_uniform_device(x: torch.Tensor, bits: int, rng: HashRNG, *, norm: Norm = Norm.MAX,
                          layout: Layout = Layout(), check: str = "sync",
                          key: torch.Tensor | None = None) -> torch.Tensor:
    """The FIXED payload of the hash-RNG uniform quantizer of ``x``, as uint8 on ``x.device``.

    Byte-identical to ``encode_uniform_fast(x, bits, rng, norm=norm, layout=layout,
    coding=Coding.FIXED)`` (l2 norm on a non-CPU device: see the module docstring).

    ``check="sync"`` (default) refuses like the host kernel, which costs one small device→host
    read of two flags. ``check="defer"`` does not sync: a non-finite input, or a norm so small
    that s/norm overflows, writes a NaN scale instead, which every decoder refuses.

    ``key``: the device tensor the kernels read the uniforms' key from (1 element, int64; default:
    a buffer of the workspace into which ``rng.key`` is written, :func:`dqsgd.kernels.workspace.step_key`).
    Given, it is read as it is (the caller has written ``rng.key`` into it with ``workspace.write_key``):
    a CUDA graph captured around the call replays with whatever key is written into it before the replay.

    Raises:
      NonFiniteGradientError: ``x`` has NaN or Inf (``check="sync"``).
      ValueError: bits outside 1..16, a bad norm, layout, shape or ``check``; a too small norm.
    """
    check_bits(bits, 1, 16, "device uniform quantizer")
    if norm not in (Norm.MAX, Norm.L2):
        raise ValueError(f"device uniform quantizer: norm must be Norm.MAX or Norm.L2, got {norm!r}")
    if check not in _CHECKS:
        raise ValueError(f"check must be one of {_CHECKS}, got {check!r}")
    tri = isinstance(x, torch.Tensor) and x.dtype in _TRITON_DTYPES and use_triton(x.device)
    flat = x.detach().reshape(-1).contiguous() if tri else flat_float(x).contiguous()  # Triton widens in-kernel
    shape, n = tuple(int(d) for d in x.shape), flat.numel()
    if n >= 1 << 32 or len(shape) > wire.MAX_NDIM or any(d > wire.U32_MAX for d in shape):
        raise ValueError(f"shape {shape}: need ndim ≤ {wire.MAX_NDIM}, every dim < 2^32 and < 2^32 elements")
    tpl = template(shape, bits, Norm(norm), layout, x.dtype)
    dev, levels = flat.device, levels_for_bits(bits)
    if tri:
        return _encode_triton(flat, Norm(norm), tpl, layout, step_key("one", rng.key, dev, key), bits, levels, check)
    scales = device_scales(flat, norm, layout, tpl.nseg, tri)
    inv = _inverse(scales, levels)
    if check == "sync":
        _refuse(scales, inv, levels)
    else:
        scales = torch.where(torch.isfinite(inv), scales, torch.full_like(scales, float("nan")))
    head, _ = head_on(tpl, dev)
    k = len(tpl.head)
    payload = torch.empty(k + tpl.body_len + 4, dtype=torch.uint8, device=dev)
    payload[:k] = head
    payload[tpl.scale_at : tpl.scale_at + 4 * tpl.nseg] = scales.contiguous().view(torch.uint8)
    key = step_key("one", rng.key, dev, key).reshape(())  # a fill: no host copy
    bucket = layout.bucket if layout.sizes is None else 0
    payload[k:-4] = kernel(_quantize_pack, dev)(flat, inv, seg_ids_of(layout, dev), key, bits, levels, bucket)
    m = payload.numel() - 4
    payload[-4:] = kernel(_crc_bytes, dev)(payload[:-4], crc_tables(dev, m), crc32_length_constant(m))
    return payload
