"""The convenience API: ``encode(tensor, ...) -> bytes`` and ``decode(bytes) -> tensor``, and its
device form: a payload as a ``uint8`` tensor on the input's device (:func:`encode_tensor`), decoded
onto a named device (``decode(payload, device=...)``) or added into a tensor where it lives
(:func:`decode_into`).

The bytes are the same in both forms: a payload tensor holds exactly the bytes :func:`encode`
returns. Where the compiled device codec ``dqsgd.kernels.device`` is installed, tensors on a
non-CPU device are encoded (uniform scheme with a :class:`~dqsgd.kernels.HashRNG`, fixed coding)
and decoded there; everything else, and every CPU tensor, goes through the host codec, with the
payload moved through host memory.
"""

from __future__ import annotations

import importlib
import inspect
import math
from types import ModuleType
from typing import Any

import torch

from dqsgd.codecs import Coding, encode as encode_payload
from dqsgd.codecs.header import PEEK_BYTES, Header, PayloadError, peek_shape
from dqsgd.codecs.wire import body_width, decode as decode_payload, read_header
from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast
from dqsgd.quantizers import Layout, Norm, Scheme, dequantize, quantizer
from dqsgd.quantizers.base import narrows, overflow

__all__ = ["DEFAULT_MAX_DECODE_BYTES", "DEFAULT_MAX_NUMEL", "decode", "decode_into", "encode", "encode_tensor"]

# What ``decode`` may allocate unless told ``numel=`` or ``max_numel=``: 256 MiB. Some valid payloads
# of a few bytes describe far bigger tensors (an Elias body codes trailing zeros in no bits, a
# one-symbol rANS body a constant tensor), so the payload length cannot bound the result: this cap
# does, for every dtype and coding (:func:`decode_bytes_per_element`). For a FIXED float32 payload
# it is 2^26 = 67,108,864 elements (DEFAULT_MAX_NUMEL, the most any payload gets by default).
DEFAULT_MAX_DECODE_BYTES = 256 << 20
DEFAULT_MAX_NUMEL = DEFAULT_MAX_DECODE_BYTES // 4
_CHUNK = 1 << 20  # elements narrowed to the payload's dtype at a time (a small temporary)
_NORMS = {"inf": Norm.MAX, "2": Norm.L2, 2: Norm.L2}
Payload = bytes | bytearray | memoryview | torch.Tensor


def _device_kernels(device: torch.device) -> ModuleType | None:
    """``dqsgd.kernels.device`` for a non-CPU device where it is installed, else None (host codec)."""
    if device.type == "cpu":
        return None
    try:
        return importlib.import_module("dqsgd.kernels.device")
    except ModuleNotFoundError as e:
        if e.name != "dqsgd.kernels.device":
            raise
        return None


def _encode(tensor: torch.Tensor, scheme: str, bits: int, norm: str | int, bucket: int, coding: str,
            generator: torch.Generator | None, rng: HashRNG | None) -> bytes | torch.Tensor:
    """The payload: bytes from the host codec, or a uint8 tensor from the device codec."""
    cod = Coding.from_name(coding)
    if norm not in _NORMS:
        raise ValueError(f"unknown norm {norm!r}; use 'inf' or '2'")
    layout, q = Layout(bucket=bucket), quantizer(scheme)
    if rng is None:
        return encode_payload(q.quantize(tensor, bits, generator, norm=_NORMS[norm], layout=layout), cod)
    if not q.fused or generator is not None:
        raise ValueError("rng= (a HashRNG) draws the uniform scheme's uniforms: use it with scheme='uniform' "
                         "and without generator=")
    if cod == Coding.FIXED and (mod := _device_kernels(tensor.device)) is not None:
        return mod.encode_uniform_device(tensor, bits, rng, norm=_NORMS[norm], layout=layout)
    return encode_uniform_fast(tensor, bits, rng, norm=_NORMS[norm], layout=layout, coding=cod)


def encode(
    tensor: torch.Tensor,
    *,
    scheme: str = "uniform",
    bits: int = 4,
    norm: str | int = "inf",
    bucket: int = 0,
    coding: str = "fixed",
    generator: torch.Generator | None = None,
    rng: HashRNG | None = None,
) -> bytes:
    """Quantize ``tensor`` with ``scheme`` (uniform | sign | scaled-sign | ternary | lowprec | identity)
    and return the self-describing payload that would cross the wire.

    ``coding``: "fixed" (bit-packed), "elias" (QSGD's Elias-omega code of the levels),
    "zstd" (zstd on the packed codes), "zstd-aligned" (zstd on codes padded to a byte-aligned width:
    closer to the entropy at 3, 5, 6, 7 bits), "rans" (static rANS of the levels: within ~0.1% of their
    empirical entropy plus a small frequency table; integer schemes only), "ransx" (the same table,
    8 interleaved rANS states: up to 60 bytes longer, about twice as fast to decode) or "auto" (the
    smallest of fixed, elias, zstd-aligned and rans; ransx in place of rans from 2^16 elements on).

    Randomness: ``generator`` (a ``torch.Generator``) draws the rounding uniforms with torch ops;
    ``rng`` (a :class:`~dqsgd.kernels.HashRNG` of (seed, step, worker); uniform scheme only) draws
    them from a counter-based hash instead, through the fused kernels. For the same ``rng`` the
    payload is the same bytes on every device and thread count.

    The payload records ``tensor.dtype`` (float32, float16, bfloat16 or float64), which
    :func:`decode` restores; the arithmetic is float32.
    """
    payload = _encode(tensor, scheme, bits, norm, bucket, coding, generator, rng)
    return payload.cpu().numpy().tobytes() if isinstance(payload, torch.Tensor) else payload


def encode_tensor(tensor: torch.Tensor, **options: Any) -> torch.Tensor:
    """:func:`encode` (the same keywords), with the payload as a 1-D ``uint8`` tensor on
    ``tensor.device``: the same bytes.

    With ``rng``, fixed coding and ``dqsgd.kernels.device`` installed, a non-CPU tensor is encoded
    on its device with no host copy; otherwise the host codec encodes and the bytes are copied back.
    """
    args = inspect.signature(encode).bind(tensor, **options)  # encode's keywords, checked by name
    args.apply_defaults()
    payload = _encode(**args.arguments)
    if isinstance(payload, torch.Tensor):
        return payload
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(tensor.device)


def _as_tensor(payload: Payload, device: torch.device) -> torch.Tensor:
    if isinstance(payload, torch.Tensor):
        return _check_tensor_payload(payload).to(device)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


def _check_tensor_payload(payload: torch.Tensor) -> torch.Tensor:
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"a payload tensor is 1-D uint8, got {payload.dtype} of shape {tuple(payload.shape)}")
    return payload


def _host_bytes(payload: Payload) -> bytes | bytearray | memoryview:
    """The payload's bytes in host memory (a view for CPU tensors, one copy from a device)."""
    if isinstance(payload, torch.Tensor):
        return memoryview(_check_tensor_payload(payload).detach().cpu().contiguous().numpy())
    return payload


def decode_bytes_per_element(coding: Coding, bits: int, dtype: torch.dtype, scheme: Scheme = Scheme.UNIFORM) -> int:
    """Bytes :func:`decode` holds per element at its peak (the payload itself not counted): the
    float32 accumulator (4), the int32 codes where the body is decoded to codes first (ELIAS, RANS, RANSX,
    and SIGN codes wider than 1 bit: 4), the decompressed body of a zstd frame (its width / 8), and
    the result in the payload's dtype when that is not float32 (its item size)."""
    per = 4
    if coding in (Coding.ELIAS, Coding.RANS, Coding.RANSX) or (scheme == Scheme.SIGN and bits > 1):
        per += 4
    elif coding in (Coding.ZSTD, Coding.ZSTD_ALIGNED):
        per += -(-body_width(bits, coding) // 8)
    return per + (0 if dtype == torch.float32 else dtype.itemsize)


def _check_default_cap(numel: int, per_element: int, what: str) -> None:
    if numel * per_element > DEFAULT_MAX_DECODE_BYTES:
        raise PayloadError(f"payload declares {numel} elements ({what}: {per_element} bytes each while decoding), "
                           f"more than the default cap of {DEFAULT_MAX_DECODE_BYTES >> 20} MiB; pass numel= or "
                           f"max_numel= to decode it")


def decode(
    payload: Payload,
    *,
    device: torch.device | str | None = None,
    numel: int | None = None,
    max_numel: int | None = None,
) -> torch.Tensor:
    """The tensor a payload stands for, in the encoded tensor's shape and dtype.

    ``payload``: bytes-like, or a 1-D ``uint8`` tensor (:func:`encode_tensor`). ``device``: where the
    result goes; by default the CPU for bytes and the payload's own device for a tensor payload.
    On a non-CPU device with ``dqsgd.kernels.device`` installed, decoding runs there (only the
    first ≤ 44 header bytes, which size the result, are read on the host).

    Bounds: ``numel`` (when the caller knows the size) must equal the payload's element count;
    else ``max_numel`` caps it; with neither, the decode may hold at most
    :data:`DEFAULT_MAX_DECODE_BYTES` = 256 MiB (:func:`decode_bytes_per_element`: 2^26 elements of
    a FIXED float32 payload, 2^25 of an Elias or rANS one, fewer for float64). All are checked
    before anything is allocated; so is what a body of its length can carry (``dqsgd.codecs.bounds``).
    A decoded value beyond the payload's dtype (a forged scale) is refused.

    Raises:
      PayloadError (a ValueError): a truncated, corrupted, foreign or oversized payload, or one
        whose element count is not ``numel``.
    """
    target = torch.device(device) if device is not None else (
        payload.device if isinstance(payload, torch.Tensor) else torch.device("cpu"))
    cap = DEFAULT_MAX_NUMEL if max_numel is None else max_numel
    if (mod := _device_kernels(target)) is None:
        return _decode_host(_host_bytes(payload), cap, numel, max_numel is None and numel is None).to(target)
    dev_payload = _as_tensor(payload, target)
    shape, dtype = peek_shape(dev_payload[:PEEK_BYTES].cpu().numpy(), cap, numel)
    if max_numel is None and numel is None:
        _check_default_cap(math.prod(shape), decode_bytes_per_element(Coding.FIXED, 8, dtype), "device decode")
    out = torch.zeros(shape, dtype=torch.float32, device=target)
    h = mod.decode_accumulate_device(dev_payload, out.view(-1), 1.0, max_numel=out.numel())
    _refuse_narrowing(out, dtype, f"{h.scheme.name} payload")
    return out.to(dtype)


def _decode_host(buf: bytes | bytearray | memoryview, cap: int, numel: int | None, default_cap: bool) -> torch.Tensor:
    """Decode on the host into one float32 accumulator (no temporary of the payload's size beyond
    what :func:`decode_bytes_per_element` counts), then narrow it to the payload's dtype."""
    h = read_header(buf, max_numel=cap, numel=numel)
    if default_cap:
        _check_default_cap(h.numel, decode_bytes_per_element(h.coding, h.bits, h.dtype, h.scheme), h.coding.name)
    if h.numel == 0:  # forged empty shapes torch cannot represent are refused there
        return dequantize(decode_payload(buf, max_numel=cap, numel=numel))
    acc = torch.full((h.numel,), -0.0, dtype=torch.float32)  # -0.0 + x == x, signed zeros included
    decode_accumulate(buf, acc, 1.0, header=h)
    return _narrowed(acc, h).reshape(h.shape)


def _narrowed(acc: torch.Tensor, h: Header) -> torch.Tensor:
    """``acc`` in the payload's dtype, chunk by chunk; a value beyond that dtype (a forged scale:
    finite in float32, ±inf after rounding) is refused. float32's own range was checked by the
    decoder before it added anything (:mod:`dqsgd.quantizers.base`)."""
    if h.dtype == torch.float32:
        return acc
    out = torch.empty(acc.numel(), dtype=h.dtype)
    for start in range(0, acc.numel(), _CHUNK):
        part = acc[start : start + _CHUNK]
        _refuse_narrowing(part, h.dtype, f"{h.scheme.name} payload")
        out[start : start + _CHUNK] = part
    return out


def _refuse_narrowing(values: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """The finite-output rule's narrowed form (:mod:`dqsgd.quantizers.base`): float32 ``values``,
    not yet in any output, must fit ``dtype`` (a host read of their largest magnitude)."""
    if narrows(dtype) and values.numel():
        if (why := overflow(float(values.abs().amax()), dtype, what)) is not None:
            raise PayloadError(why)


def decode_into(payload: Payload, out: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    """``out += weight · decode(payload)`` on ``out``'s device; returns ``out``.

    The payload must hold exactly ``out.numel()`` elements (any shape with that count; that is also
    the allocation bound). On a float32 contiguous ``out`` the sum is done in place in one pass
    (:func:`dqsgd.kernels.decode_accumulate` on the CPU; ``dqsgd.kernels.device``'s
    ``decode_accumulate_device`` on a device where it is installed, with no host copy); with
    ``weight = 1`` it equals ``out + decode(payload)`` bit for bit. Another dtype or layout of
    ``out`` gets ``weight · x̂`` in float32, added after one rounding to its dtype.

    Raises:
      PayloadError: as :func:`decode`, or a payload of another element count than ``out``, or
        whose values ``weight·x̂`` would not be finite in ``out``'s dtype (refused before anything
        is added: :mod:`dqsgd.quantizers.base`). Errors in the body are found while adding:
        ``out`` then holds a partial sum.
      ValueError: ``out`` is not a floating-point tensor.
    """
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise ValueError(f"out must be a floating-point tensor, got {getattr(out, 'dtype', type(out).__name__)}")
    n = out.numel()
    direct = out.dtype == torch.float32 and out.is_contiguous()
    acc = out.view(-1) if direct else torch.zeros(n, dtype=torch.float32, device=out.device)
    if (mod := _device_kernels(out.device)) is not None:
        h = mod.decode_accumulate_device(_as_tensor(payload, out.device), acc, weight, max_numel=n)
    else:
        buf = _host_bytes(payload)
        target = acc if acc.device.type == "cpu" else torch.zeros(n, dtype=torch.float32)
        h = decode_accumulate(buf, target, weight, header=read_header(buf, numel=n))
        if target is not acc:
            acc += target.to(acc.device)
    if not direct:
        _refuse_narrowing(acc, out.dtype, f"{h.scheme.name} payload")  # before anything is added to out
        out += acc.view(out.shape).to(out.dtype)
    return out
