"""The fused CPU path: gradient → payload bytes, and payload → ``out += w·x̂``, in compiled loops.

* :func:`encode_uniform_fast` — max-norm (or l2) per segment, stochastic rounding with the hash
  uniforms of a :class:`~dqsgd.kernels.hashrng.HashRNG`, offset-binary packing straight into the
  payload: two passes over the input, no full-size temporary. The payload is the wire format of
  :mod:`dqsgd.codecs.wire` byte for byte: ``decode`` reads it unchanged, and it equals
  ``encode(quantize_uniform(x, bits, rng=rng, …), coding)`` (bits ≥ 2; 1 bit: see below).
* :func:`quantize_uniform_fast` — the same codes as a :class:`Quantized` (for ELIAS and RANS coding and
  error feedback, which need the codes themselves).
* :func:`decode_accumulate` — validates a payload like ``decode`` and adds ``w·dequantize`` into
  ``out`` without materialising the codes or x̂ (FIXED, ZSTD and ZSTD_ALIGNED bodies; ELIAS and
  RANS decode the codes first).

One bit: a UNIFORM payload with bits = 1 and levels = 1 carries codes ±1 and the scale r = ‖v‖;
the code is +1 with probability (1 + v_i/r)/2, so E[r·c_i] = v_i (stochastic binary rounding;
variance r² − v_i²). :func:`dqsgd.kernels.reference.quantize_uniform_hash` is its torch form.

Big tensors are split over ``torch.get_num_threads()`` threads (:mod:`dqsgd.codecs.threads`; why
not ``prange``: :mod:`dqsgd.kernels.fused`); the payload is the same bytes at any thread count.
"""

from __future__ import annotations

import numpy as np
import torch

from dqsgd.codecs import Coding, PayloadError, encode as encode_payload
from dqsgd.codecs import wire  # its validators, so both paths accept and refuse the same payloads
from dqsgd.codecs.bitpack import packed_size
from dqsgd.codecs.header import MAX_NUMEL, Header, write_header
from dqsgd.codecs.wire import read_header
from dqsgd.codecs.threads import crc32, run_split
from dqsgd.kernels import fused
from dqsgd.kernels.hashrng import HashRNG
from dqsgd.quantizers import Layout, Norm, NonFiniteGradientError, Quantized, Scheme, levels_for_bits
from dqsgd.quantizers._common import check_bits, flat_float, require_finite, segment_reduce

__all__ = ["decode_accumulate", "encode_uniform_fast", "quantize_uniform_fast", "read_header", "segment_starts"]

MIN_CHUNKS_PER_THREAD = 64  # 256K coordinates: below that a thread costs more than it saves
levels_of = levels_for_bits  # this module's earlier name for it, kept for importers


def segment_starts(layout: Layout, numel: int) -> np.ndarray:
    """int64 ``[0, …, numel]``: segment k is ``[starts[k], starts[k+1])`` (no list of sizes built)."""
    if layout.sizes is not None:
        if sum(layout.sizes) != numel:
            raise ValueError(f"layout sizes sum to {sum(layout.sizes)}, tensor has {numel} elements")
        return np.concatenate(([0], np.cumsum(np.asarray(layout.sizes, dtype=np.int64)))).astype(np.int64)
    if numel == 0:
        return np.zeros(1, dtype=np.int64)
    if layout.bucket <= 0 or layout.bucket >= numel:
        return np.array([0, numel], dtype=np.int64)
    return np.append(np.arange(0, numel, layout.bucket, dtype=np.int64), np.int64(numel))


def _prepare(x: torch.Tensor, bits: int, norm: Norm, layout: Layout):
    check_bits(bits, 1, 16, "fused uniform quantizer")
    if norm not in (Norm.MAX, Norm.L2):
        raise ValueError(f"fused uniform quantizer: norm must be Norm.MAX or Norm.L2, got {norm!r}")
    flat = flat_float(x).cpu().contiguous()
    n = flat.numel()
    if n >= 1 << 32:
        raise ValueError(f"fused uniform quantizer: {n} elements, the wire carries < 2^32")
    wire.check_layout(layout, n)
    starts = segment_starts(layout, n)
    scales = np.zeros(starts.size - 1, dtype=np.float32)
    if norm == Norm.L2:  # torch's own l2 (summation order matters for bit-identical scales)
        scales = segment_reduce(flat, layout, "l2").numpy().astype(np.float32)
        require_finite(torch.from_numpy(scales), "fused uniform quantizer")
    elif n:
        parts = run_split(fused.absmax_range, n, flat.numpy().view(np.int32), starts,
                          min_per_thread=MIN_CHUNKS_PER_THREAD * fused.CHUNK)
        scales = np.maximum.reduce(parts).view(np.float32)  # max of the bits = the bits of the max
        if not np.isfinite(scales).all():  # max |x| is NaN or Inf exactly when some x_i is
            raise NonFiniteGradientError(
                f"fused uniform quantizer: input contains NaN or Inf (non-finite norm {scales.tolist()[:4]}); "
                "refusing to quantize")
    s = levels_for_bits(bits)
    sc = torch.from_numpy(scales)
    # The very expression of quantize_uniform, so inv (and so every code) is bit-identical.
    inv = torch.where(sc > 0, s / sc, torch.zeros_like(sc)).numpy()
    if not np.isfinite(inv).all():  # quantize_uniform shares this limit (its codes come out invalid)
        r = float(scales[~np.isfinite(inv)][0])
        raise ValueError(f"fused uniform quantizer: a segment norm of {r:.3g} is too small: s/norm = {s}/{r:.3g} "
                         "overflows float32 (norms must be 0 or above s·2^-128)")
    return flat, starts, sc, inv, s


def _args(flat, starts, inv, s, bits, rng):
    return (flat.numpy(), starts, inv, np.float32(s), bits == 1, np.uint64(rng.key))


def quantize_uniform_fast(x: torch.Tensor, bits: int, rng: HashRNG, *, norm: Norm = Norm.MAX,
                          layout: Layout = Layout()) -> Quantized:
    """The fused quantizer's codes and scales (what :func:`encode_uniform_fast` packs)."""
    flat, starts, scales, inv, s = _prepare(x, bits, norm, layout)
    n = flat.numel()
    codes = np.empty(n, dtype=np.int32)
    if n:
        run_split(fused.codes_range, -(-n // fused.CHUNK), *_args(flat, starts, inv, s, bits, rng), codes,
                  min_per_thread=MIN_CHUNKS_PER_THREAD)
    return Quantized(Scheme.UNIFORM, bits, s, torch.from_numpy(codes), scales, layout, tuple(x.shape),
                     norm, dtype=x.dtype)


_PACKED = (Coding.FIXED, Coding.ZSTD, Coding.ZSTD_ALIGNED)  # codings the fused kernel packs itself


def encode_uniform_fast(x: torch.Tensor, bits: int, rng: HashRNG, *, norm: Norm = Norm.MAX,
                        layout: Layout = Layout(), coding: Coding = Coding.FIXED) -> bytes:
    """The payload of the hash-RNG stochastic uniform quantizer of ``x`` at ``bits`` (1..16).

    FIXED, ZSTD and ZSTD_ALIGNED are packed in the fused kernel (straight into the payload for
    FIXED); ELIAS, RANS and AUTO go through the codes (:func:`quantize_uniform_fast`) and
    :func:`dqsgd.codecs.encode` (entropy coders need the histogram of all codes first).

    Raises:
      NonFiniteGradientError: ``x`` has NaN or Inf (nothing is encoded).
      ValueError: bits outside 1..16, a bad norm, layout or coding.
    """
    coding = Coding(coding)
    if coding not in _PACKED:
        return encode_payload(quantize_uniform_fast(x, bits, rng, norm=norm, layout=layout), coding)
    flat, starts, scales, inv, s = _prepare(x, bits, norm, layout)
    n = flat.numel()
    shape = tuple(int(d) for d in x.shape)
    if len(shape) > wire.MAX_NDIM or any(d > wire.U32_MAX for d in shape):
        raise ValueError(f"shape {shape}: need ndim ≤ {wire.MAX_NDIM} and every dim < 2^32")

    def header(body_len: int) -> bytes:
        return write_header(Scheme.UNIFORM, bits, coding, norm, s, shape, layout, scales.numpy(), body_len,
                            dtype=x.dtype)

    width = wire.body_width(bits, coding)
    body_len = packed_size(n, width)
    if coding == Coding.FIXED:
        head = header(body_len)
        buf = np.empty(len(head) + body_len + 4, dtype=np.uint8)  # the payload, packed in place
        buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        _pack(flat, starts, inv, s, bits, rng, width, buf[len(head) : len(head) + body_len])
        buf[-4:] = np.frombuffer(crc32(buf[:-4]).to_bytes(4, "little"), dtype=np.uint8)
        return buf.tobytes()
    body = np.empty(body_len, dtype=np.uint8)
    _pack(flat, starts, inv, s, bits, rng, width, body)
    zbody = wire.zstd_compress(body)
    head = header(len(zbody))
    return b"".join((head, zbody, crc32(zbody, crc32(head)).to_bytes(4, "little")))


def _pack(flat, starts, inv, s, bits, rng, width, body) -> None:
    """Quantize and pack ``flat`` into ``body`` at ``width`` ≥ bits (offset binary of ``bits``)."""
    n = flat.numel()
    if not n:
        return
    offset = 0 if bits == 1 else 1 << (bits - 1)
    run_split(fused.encode_range, -(-n // fused.CHUNK), *_args(flat, starts, inv, s, bits, rng), width, offset,
              body, min_per_thread=MIN_CHUNKS_PER_THREAD)


# ------------------------------------------------------------------------------------ decode


def _out_array(out: torch.Tensor | np.ndarray, numel: int) -> np.ndarray:
    arr = out.numpy() if isinstance(out, torch.Tensor) else out
    if arr.dtype != np.float32 or not arr.flags.c_contiguous or not arr.flags.writeable or arr.size != numel:
        raise ValueError(f"out must be a writable contiguous float32 CPU array of {numel} elements, "
                         f"got {arr.dtype} {arr.shape}")
    return arr.reshape(-1)


def decode_accumulate(payload: bytes | bytearray | memoryview, out: torch.Tensor | np.ndarray,
                      weight: float = 1.0, *, header: Header | None = None, max_numel: int = MAX_NUMEL) -> Header:
    """``out += weight · dequantize(decode(payload))``, validating the payload like ``decode``.

    With ``weight = 1`` the sum is bit-identical to adding ``dequantize(decode(payload))``.
    ``header`` (from :func:`read_header`) skips re-parsing. Returns the header.

    Raises:
      PayloadError: whatever ``decode`` refuses. Body errors (codes out of range) are found
        while accumulating: ``out`` then holds a partial sum and must be discarded.
      ValueError: ``out`` is not a contiguous float32 CPU buffer of the payload's numel.
    """
    h = header if header is not None else read_header(payload, max_numel=max_numel)
    arr = _out_array(out, h.numel)
    buf = memoryview(payload).cast("B")
    w = np.float32(weight)
    rng = wire.code_range(h.scheme, h.bits, h.levels)
    if (h.coding in (Coding.ELIAS, Coding.RANS) or h.numel == 0
            or (h.scheme != Scheme.IDENTITY and not rng.zero_ok and h.bits > 1)):
        # ELIAS, RANS (and SIGN codes wider than 1 bit, which must not be 0): the validated codes first.
        data = wire.decode_body(buf, h)
        if h.numel:
            fused.accumulate_codes(data, segment_starts(h.layout, h.numel), _steps(h), w, arr)
        return h
    body = buf[h.body_start : h.body_start + h.body_len]
    width = wire.body_width(h.bits, h.coding)
    if h.coding in (Coding.ZSTD, Coding.ZSTD_ALIGNED):
        body = wire.unzstd(body, packed_size(h.numel, width), h.body_start)
    _check_fixed_body(body, h, width)
    data = np.frombuffer(body, dtype=np.uint8)
    chunks = -(-h.numel // fused.CHUNK)
    if h.scheme == Scheme.IDENTITY:
        run_split(fused.accumulate_values, chunks, data.view("<f4"), w, arr, min_per_thread=MIN_CHUNKS_PER_THREAD)
        return h
    bits, starts = h.bits, segment_starts(h.layout, h.numel)
    offset = 0 if bits == 1 else 1 << (bits - 1)
    spans = run_split(fused.accumulate_range, chunks, data, width, offset, bits == 1, starts, _steps(h), w, arr,
                      min_per_thread=MIN_CHUNKS_PER_THREAD)
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    if lo < rng.lo or hi > rng.hi:  # 1-bit codes are ±1 by construction: never 0
        raise PayloadError(
            f"body at offset {h.body_start}: codes span [{lo}, {hi}], the scheme allows [{rng.lo}, {rng.hi}]")
    return h


def _steps(h: Header) -> np.ndarray:
    """scale/levels per segment, computed as ``dequantize`` computes it."""
    return (torch.from_numpy(h.scales).to(torch.float32) / float(h.levels)).numpy()


def _check_fixed_body(body: memoryview, h: Header, width: int) -> None:
    need = packed_size(h.numel, width)
    if len(body) != need:
        raise PayloadError(f"body at offset {h.body_start} has {len(body)} bytes, {h.numel}×{width} bits need {need}")
    tail = (h.numel * width) % 8
    if tail and body[-1] >> tail:
        raise PayloadError(f"non-zero padding bits in the last body byte (offset {h.body_start + len(body) - 1})")
