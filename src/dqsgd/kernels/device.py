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

Compilation. On CUDA the n-sized kernels (max norm, quantize + pack, the crc tree, and decoding)
run under ``torch.compile(dynamic=False)``: inductor fuses the hash, rounding and packing of
each element into one pass, which eager ops (one kernel and one full-size temporary per op) cannot;
Triton is only reached through it, so there is no new dependency. On CPU the eager ops run by
default (the numba kernels are the CPU fast path); :func:`set_compile` forces either. GPU speed:
not measured here.

What costs a host sync: see :func:`encode_uniform_device` and :func:`decode_accumulate_device`.
"""

from __future__ import annotations

import torch

from dqsgd.codecs import wire  # its validators, so both paths accept and refuse the same payloads
from dqsgd.kernels.device_common import expected_header, head_on, kernel, per_element, seg_ids_of, set_compile, template
from dqsgd.kernels.device_crc import crc32_length_constant, crc32_with, crc_tables
from dqsgd.kernels.device_decode import decode_accumulate_device, decode_device
from dqsgd.kernels.device_pack import pack_device
from dqsgd.kernels.hashrng import HashRNG, signed64, hash_uniform_torch
from dqsgd.quantizers import Layout, Norm, NonFiniteGradientError, levels_for_bits
from dqsgd.quantizers.segments import check_bits, flat_float, segment_reduce

__all__ = ["decode_accumulate_device", "decode_device", "encode_uniform_device", "expected_header", "set_compile"]

_CHECKS = ("sync", "defer")

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


def _scales(flat: torch.Tensor, norm: Norm, layout: Layout, seg_ids: torch.Tensor | None, nseg: int) -> torch.Tensor:
    if norm == Norm.L2:  # the host kernel's own expression (summation order matters for the bits)
        return segment_reduce(flat, layout, "l2").to(torch.float32)
    bucket = layout.bucket if layout.sizes is None else 0
    return kernel(_absmax, flat.device)(flat, seg_ids, bucket, nseg)


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


def encode_uniform_device(x: torch.Tensor, bits: int, rng: HashRNG, *, norm: Norm = Norm.MAX,
                          layout: Layout = Layout(), check: str = "sync") -> torch.Tensor:
    """The FIXED payload of the hash-RNG uniform quantizer of ``x``, as uint8 on ``x.device``.

    Byte-identical to ``encode_uniform_fast(x, bits, rng, norm=norm, layout=layout,
    coding=Coding.FIXED)`` (l2 norm on a non-CPU device: see the module docstring).

    ``check="sync"`` (default) refuses like the host kernel, which costs one small device→host
    read of two flags. ``check="defer"`` does not sync: a non-finite input, or a norm so small
    that s/norm overflows, writes a NaN scale instead, which every decoder refuses.

    Raises:
      NonFiniteGradientError: ``x`` has NaN or Inf (``check="sync"``).
      ValueError: bits outside 1..16, a bad norm, layout, shape or ``check``; a too small norm.
    """
    check_bits(bits, 1, 16, "device uniform quantizer")
    if norm not in (Norm.MAX, Norm.L2):
        raise ValueError(f"device uniform quantizer: norm must be Norm.MAX or Norm.L2, got {norm!r}")
    if check not in _CHECKS:
        raise ValueError(f"check must be one of {_CHECKS}, got {check!r}")
    flat = flat_float(x).contiguous()
    shape, n = tuple(int(d) for d in x.shape), flat.numel()
    if n >= 1 << 32 or len(shape) > wire.MAX_NDIM or any(d > wire.U32_MAX for d in shape):
        raise ValueError(f"shape {shape}: need ndim ≤ {wire.MAX_NDIM}, every dim < 2^32 and < 2^32 elements")
    tpl = template(shape, bits, Norm(norm), layout, x.dtype)
    dev, levels = flat.device, levels_for_bits(bits)
    seg_ids = seg_ids_of(layout, dev)
    scales = _scales(flat, norm, layout, seg_ids, tpl.nseg)
    inv = torch.where(scales > 0, levels / scales, torch.zeros_like(scales))  # the host's expression
    if check == "sync":
        _refuse(scales, inv, levels)
    else:
        scales = torch.where(torch.isfinite(inv), scales, torch.full_like(scales, float("nan")))
    key = torch.full((), signed64(rng.key), dtype=torch.int64, device=dev)  # a fill: no host copy
    bucket = layout.bucket if layout.sizes is None else 0
    body = kernel(_quantize_pack, dev)(flat, inv, seg_ids, key, bits, levels, bucket)
    head, _ = head_on(tpl, dev)
    payload = torch.empty(len(tpl.head) + tpl.body_len + 4, dtype=torch.uint8, device=dev)
    payload[: len(tpl.head)] = head
    payload[tpl.scale_at : tpl.scale_at + 4 * tpl.nseg] = scales.contiguous().view(torch.uint8)
    payload[len(tpl.head) : -4] = body
    m = payload.numel() - 4
    payload[-4:] = kernel(_crc_bytes, dev)(payload[:-4], crc_tables(dev, m), crc32_length_constant(m))
    return payload
