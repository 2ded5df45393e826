"""Decoding a payload tensor on its own device: ``out += w·dequantize(decode(payload))``.

See :func:`decode_accumulate_device`; the arithmetic and why it is bit-identical to the host
kernel are in :mod:`dqsgd.kernels.device`.
"""

from __future__ import annotations

import numpy as np
import torch

from dqsgd.codecs import Coding, PayloadError
from dqsgd.codecs import wire  # its validators, so both paths accept and refuse the same payloads
from dqsgd.codecs.header import MAX_NUMEL, Header, parse_header
from dqsgd.codecs.header import top_code
from dqsgd.kernels.codec import decode_accumulate
from dqsgd.kernels.device_common import (
    LazyBytes, Template, head_on, kernel, per_element, seg_ids_of, template, use_triton,
)
from dqsgd.kernels.device_crc import crc32_length_constant, crc32_with, crc_tables
from dqsgd.kernels.device_pack import padding_bits, unpack_device
from dqsgd.quantizers import Scheme
from dqsgd.quantizers.base import beyond, overflow, step_bound

__all__ = ["decode_accumulate_device", "decode_device"]

_CHECKS = ("sync", "defer")
_PREFETCH = 4096  # header bytes read to the host in one copy (more only for long layouts or many scales)
_ON_DEVICE = (Scheme.UNIFORM, Scheme.SIGN, Scheme.TERNARY)  # with FIXED coding; others take the host path


def _host_header(payload: torch.Tensor, max_numel: int) -> Header:
    """``read_header``'s checks but the crc (made on the device), reading only the header bytes to the
    host (a sync; a RANS body's first bytes too)."""
    n = payload.numel()
    first = bytes(payload[: min(n, _PREFETCH)].cpu().numpy())

    def fetch(lo: int, hi: int) -> bytes:
        return first[lo:hi] if hi <= len(first) else bytes(payload[lo:hi].cpu().numpy())

    h = parse_header(LazyBytes(n, fetch), max_numel)
    wire.check_parsed(h, LazyBytes(h.body_len, lambda lo, hi: fetch(h.body_start + lo, h.body_start + hi)))
    return h


def _dequantize(body: torch.Tensor, steps: torch.Tensor, seg_ids: torch.Tensor | None, w: torch.Tensor,
                bits: int, bucket: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w·(c·step) per coordinate, [min c, max c, zero count]) of a FIXED body of n codes."""
    u = unpack_device(body, bits, n)
    codes = 2 * u - 1 if bits == 1 else u - (1 << (bits - 1))
    dx = w * (codes.to(torch.float32) * per_element(steps, seg_ids, bucket, n))
    if n == 0:
        return dx, torch.zeros(3, dtype=torch.int64, device=body.device)
    stats = torch.stack([codes.min().to(torch.int64), codes.max().to(torch.int64), (codes == 0).sum()])
    return dx, stats


def _crc_pair(payload: torch.Tensor, tabs: torch.Tensor, constant: int) -> torch.Tensor:
    """[computed crc, stored crc] of a payload (int64, on its device; ``device_crc``)."""
    stored = (payload[-4:].to(torch.int64) << torch.arange(0, 32, 8, device=payload.device)).sum()
    return torch.stack([crc32_with(payload[:-4], tabs, constant), stored])


def _expected_template(h: Header) -> Template:
    """The template of an expected header ``h`` (refused if it is not one)."""
    tpl = template(h.shape, h.bits, h.norm, h.layout, h.dtype)
    if tpl.header.levels != h.levels or h.scheme != Scheme.UNIFORM or h.coding != Coding.FIXED:
        raise ValueError("header= must come from expected_header (a UNIFORM FIXED payload's header)")
    return tpl


_DIVISORS: dict[tuple[str, int], torch.Tensor] = {}


def step_divisor(device: torch.device, levels: int) -> torch.Tensor:
    """``levels`` as a 1-element float32 tensor on ``device`` (a tensor divisor: ``r / levels`` is then
    correctly rounded everywhere), made once per device."""
    key = (str(device), levels)
    if key not in _DIVISORS:
        _DIVISORS[key] = torch.full((1,), float(levels), dtype=torch.float32, device=device)
    return _DIVISORS[key]


def _template_flags(payload: torch.Tensor, h: Header) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales read from the payload on device, [header bytes differ, non-finite scale]) for a
    payload expected to have the header ``h`` (from :func:`expected_header`)."""
    tpl = _expected_template(h)
    dev, k = payload.device, len(tpl.head)
    head, care = head_on(tpl, dev)
    scales = payload[tpl.scale_at : tpl.scale_at + 4 * tpl.nseg].clone().view(torch.float32)
    differs = ((payload[:k] != head) & care).any()
    return scales, torch.stack([differs, ~torch.isfinite(scales).all()]).to(torch.int64)


def _raise_first(stats: list[int], h: Header) -> None:
    """The host decoder's message for the first failed check, in its order."""
    head_bad, scale_bad, computed, stored, pad, lo, hi, zeros, over = stats
    rng = wire.code_range(h.scheme, h.bits, h.levels)
    if head_bad:
        raise PayloadError(f"header differs from the expected header {h.shape} bits={h.bits} (outside the scales)")
    if scale_bad:
        raise PayloadError("non-finite scale in the scales")
    if computed != stored:
        raise PayloadError(f"crc mismatch: stored {stored:#010x} at offset {h.body_start + h.body_len}, "
                           f"computed {computed:#010x}")
    if over:
        raise PayloadError(overflow(float("inf"), torch.float32, f"{h.scheme.name} payload") or "")
    if pad:
        raise PayloadError(f"non-zero padding bits in the last body byte (offset {h.body_start + h.body_len - 1})")
    if h.numel and (lo < rng.lo or hi > rng.hi):
        raise PayloadError(f"body at offset {h.body_start}: codes span [{lo}, {hi}], "
                           f"the scheme allows [{rng.lo}, {rng.hi}]")
    if zeros and not rng.zero_ok:
        raise PayloadError(f"body at offset {h.body_start}: {zeros} zero codes, "
                           "which this scheme and width cannot carry")


def _flagged(stats: torch.Tensor, h: Header) -> torch.Tensor:
    """Whether any check failed, as a device bool (the no-sync form of :func:`_raise_first`)."""
    rng = wire.code_range(h.scheme, h.bits, h.levels)
    bad = (stats[0] != 0) | (stats[1] != 0) | (stats[2] != stats[3]) | (stats[4] != 0) | (stats[8] != 0)
    if h.numel:
        bad = bad | (stats[5] < rng.lo) | (stats[6] > rng.hi) | ((stats[7] > 0) & (not rng.zero_ok))
    return bad


def _check_args(payload: torch.Tensor, check: str, bad: torch.Tensor | None) -> None:
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        got = f"{payload.dtype} {tuple(payload.shape)}" if isinstance(payload, torch.Tensor) else type(payload).__name__
        raise ValueError(f"payload must be a 1-D uint8 tensor, got {got}")
    if check not in _CHECKS:
        raise ValueError(f"check must be one of {_CHECKS}, got {check!r}")
    if check == "defer" and (not isinstance(bad, torch.Tensor) or bad.dtype != torch.bool or bad.dim() != 0
                             or bad.device != payload.device):
        raise ValueError("check='defer' needs bad=, a 0-dim bool tensor on the payload's device")


def _resolve(payload: torch.Tensor, header: Header | None, max_numel: int) -> tuple[Header, bool]:
    """(header, whether it is a caller's expected header) after the host-side length checks."""
    if header is None:
        return _host_header(payload, max_numel), False
    if header.numel > max_numel:
        raise PayloadError(f"expected header declares {header.numel} elements, more than max_numel={max_numel}")
    if payload.numel() != header.body_start + header.body_len + 4:
        raise PayloadError(f"payload has {payload.numel()} bytes, the expected header says "
                           f"{header.body_start + header.body_len + 4}")
    return header, True


def _accumulate(payload: torch.Tensor, out: torch.Tensor, weight: float, h: Header, expected: bool,
                check: str, bad: torch.Tensor | None) -> None:
    dev = payload.device
    if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != h.numel or out.device != dev:
        raise ValueError(f"out must be a contiguous float32 tensor of {h.numel} elements on {dev}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if h.coding != Coding.FIXED or h.scheme not in _ON_DEVICE:  # other codings: the host decoder (a copy)
        tmp = np.zeros(h.numel, dtype=np.float32)
        decode_accumulate(bytes(payload.cpu().numpy()), tmp, weight, max_numel=max(h.numel, 1))
        out.view(-1).add_(torch.from_numpy(tmp).to(dev))
        return
    if use_triton(dev):
        _accumulate_triton(payload.contiguous(), out.view(-1), weight, h, expected, check, bad)
        return
    if expected:
        scales, head_flags = _template_flags(payload, h)
    else:
        scales = torch.from_numpy(h.scales.astype(np.float32)).to(dev)
        head_flags = torch.zeros(2, dtype=torch.int64, device=dev)
    steps = scales / step_divisor(dev, h.levels)
    over = _over(steps, h, weight).to(torch.int64).reshape(1)
    payload = payload.contiguous()
    body = payload[h.body_start : h.body_start + h.body_len]
    w = torch.full((), weight, dtype=torch.float32, device=dev)
    bucket = h.layout.bucket if h.layout.sizes is None else 0
    dx, code_stats = kernel(_dequantize, dev)(body, steps, seg_ids_of(h.layout, dev), w, h.bits, bucket, h.numel)
    pad = padding_bits(body, h.bits, h.numel).to(torch.int64).reshape(1)
    stats = torch.cat([head_flags, kernel(_crc_pair, dev)(payload, crc_tables(dev, payload.numel() - 4),
                                                   crc32_length_constant(payload.numel() - 4)), pad, code_stats, over])
    _settle(stats, h, check, bad)
    out.view(-1).add_(dx)  # eager and separate: never contracted into an FMA (module docstring)


def _over(steps: torch.Tensor, h: Header, weight: float) -> torch.Tensor:
    """The finite-output rule's flag (:mod:`dqsgd.quantizers.base`), a 0-dim device bool made where
    the steps are (no sync): some segment's scale times the top code, times ``weight``, overflows
    float32. It joins the other checks' flags: read in their one sync, or ORed into ``bad``."""
    bound = step_bound(steps, top_code(h.scheme, h.bits, h.levels), weight)
    if h.layout.sizes is not None and 0 in h.layout.sizes:  # a segment with no coordinate decodes nothing
        bound = torch.where(torch.tensor([n > 0 for n in h.layout.sizes], device=steps.device), bound, 0.0)
    return beyond(bound, torch.float32)


def _settle(stats: torch.Tensor, h: Header, check: str, bad: torch.Tensor | None) -> None:
    """Raise on the first failed check (``sync``: the one sync, 9 integers) or OR them into ``bad``."""
    if check == "sync":
        _raise_first(stats.tolist(), h)
    else:
        bad |= _flagged(stats, h)


def _accumulate_triton(payload: torch.Tensor, flat: torch.Tensor, weight: float, h: Header, expected: bool,
                       check: str, bad: torch.Tensor | None) -> None:
    """The Triton kernels' decode (:mod:`dqsgd.kernels.triton_decode`): the same checks, made in the
    crc's last level (which starts the stats) and the decode kernel (header bytes, scales, padding,
    codes, and the finite-output rule from each coordinate's step: no launch of its own); with ``defer`` a failed check sets ``bad`` where it is found. The same sum. With
    ``check="sync"`` the codes are scanned first and added only once every check passed (so a
    refused payload leaves ``out`` untouched): two reads of the (small) body; ``defer``: one."""
    from dqsgd.kernels.triton_decode import STATS, Checks, accumulate_triton
    from dqsgd.kernels.triton_crc import crc32_triton

    dev, rng = payload.device, wire.code_range(h.scheme, h.bits, h.levels)
    body = payload[h.body_start : h.body_start + h.body_len]
    stats, flag = torch.empty(STATS, dtype=torch.int32, device=dev), bad if check == "defer" else None
    if expected:
        tpl = _expected_template(h)
        scales = torch.empty(tpl.nseg, dtype=torch.float32, device=dev)  # the stored ones, copied by the crc
        crc32_triton(payload[:-4], payload[-4:], stats, flag, copy=(scales.view(torch.uint8), tpl.scale_at))
        where = (head_on(tpl, dev)[0], len(tpl.head), tpl.scale_at, tpl.nseg)
    else:  # the header was read and checked on the host
        scales = torch.from_numpy(h.scales.astype(np.float32)).to(dev)
        crc32_triton(payload[:-4], payload[-4:], stats, flag)
        where = (payload, 0, 0, 0)
    steps = scales / step_divisor(dev, h.levels)
    checks = Checks(stats, flag, payload, *where, rng.lo, rng.hi, rng.zero_ok)
    accumulate_triton(body, steps, h.layout, weight, h.bits, h.numel, flat, check == "defer", checks)
    if check == "sync":
        head_bad, scale_bad, crc_bad, pad, lo, hi, zeros, _, over_bad = stats.tolist()  # the one sync
        computed = stored = 0
        if crc_bad:  # the values, for the message
            computed = int(crc32_triton(payload[:-4])) & 0xFFFFFFFF
            stored = int.from_bytes(bytes(payload[-4:].cpu().numpy()), "little")
        _raise_first([head_bad, scale_bad, computed, stored, pad, lo, hi, zeros, over_bad], h)
        accumulate_triton(body, steps, h.layout, weight, h.bits, h.numel, flat, True, None)


def decode_accumulate_device(payload: torch.Tensor, out: torch.Tensor, weight: float = 1.0, *,
                             max_numel: int = MAX_NUMEL, header: Header | None = None, check: str = "sync",
                             bad: torch.Tensor | None = None) -> Header:
    """``out += weight · dequantize(decode(payload))`` on the payload's device; returns the header.

    ``payload`` is a 1-D uint8 tensor, ``out`` a contiguous float32 tensor of numel elements on the
    same device. With ``weight = 1`` the result is bit-identical to the host
    :func:`dqsgd.kernels.decode_accumulate` (any weight: the same float32 operations).

    Host syncs. ``header=None``: the header is read to the host (one copy of its first 4 KiB)
    and checked there like ``read_header``. ``header=expected_header(shape, bits, norm=,
    layout=)``: nothing is read; the payload's length is checked on the host (it is a tensor
    shape), its header bytes outside the scales are compared with the expected ones on the device,
    and the scales are read on the device (the returned header is the caller's, with its
    placeholder scales). Then the crc (``device_crc``), the padding bits, the code range and the
    finite-output rule (:mod:`dqsgd.quantizers.base`: some scale times the top code, times
    ``weight``, overflows float32; computed on the device from the scales where they already are,
    so it needs no sync of its own) are device flags: ``check="sync"`` reads them (8 integers) and raises on a bad payload, leaving
    ``out`` untouched; ``check="defer"`` ORs them into ``bad`` (a 0-dim bool tensor on the device)
    without a sync, and adds into ``out`` anyway: the caller must check ``bad`` before trusting
    ``out``. Payloads the device kernel does not decode (codings other than FIXED, IDENTITY and
    LOWPREC schemes) are copied to the host and decoded there (a sync, and errors are raised).

    Raises:
      PayloadError: whatever ``decode`` refuses (truncated, corrupted, forged), and a header that
        differs from ``header``.
      ValueError: a bad ``payload``/``out`` tensor, ``check`` or ``bad``.
    """
    _check_args(payload, check, bad)
    h, expected = _resolve(payload, header, max_numel)
    _accumulate(payload, out, weight, h, expected, check, bad)
    return h


def decode_device(payload: torch.Tensor, *, max_numel: int = MAX_NUMEL, header: Header | None = None,
                  check: str = "sync", bad: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize(decode(payload))`` on the payload's device, in the payload's shape and recorded
    dtype (float32 sums, rounded once to that dtype, as the host decoder does; syncs and checks as
    in :func:`decode_accumulate_device`).

    A float16/bfloat16 payload whose values would be ±inf in its dtype (a forged scale) is refused
    as the host decoder refuses it (:mod:`dqsgd.quantizers.base`, narrowed form: the values' largest
    magnitude, a device flag): ``check="sync"`` reads the flag (one more sync, narrow dtypes only),
    ``"defer"`` ORs it into ``bad``."""
    _check_args(payload, check, bad)
    h, expected = _resolve(payload, header, max_numel)
    out = torch.zeros(h.numel, dtype=torch.float32, device=payload.device)
    _accumulate(payload, out, 1.0, h, expected, check, bad)
    if h.dtype != torch.float32:  # float32 itself: the in-place bound of _accumulate
        over = beyond(out.abs(), h.dtype)
        if check == "defer":
            bad |= over  # type: ignore[operator]
        elif bool(over):
            raise PayloadError(overflow(float(out.abs().amax()), h.dtype, f"{h.scheme.name} payload") or "")
    return out.reshape(h.shape).to(h.dtype)
