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

import functools

import numpy as np
import torch

from dqsgd.codecs import Coding, PayloadError, encode as encode_payload
from dqsgd.codecs import wire  # its validators, so both paths accept and refuse the same payloads
from dqsgd.codecs.bitpack import packed_size
from dqsgd.codecs.header import MAX_NUMEL, Header, write_header
from dqsgd.codecs.header import top_code
from dqsgd.codecs.wire import read_header
from dqsgd.codecs.threads import crc32, run_split
from dqsgd.kernels import fused, recent
from dqsgd.kernels.hashrng import HashRNG
from dqsgd.quantizers import Layout, Norm, NonFiniteGradientError, Quantized, Scheme, levels_for_bits
from dqsgd.quantizers.base import RAW_SCHEMES
from dqsgd.quantizers.base import overflow, step_bound
from dqsgd.quantizers.segments import check_bits, flat_float, require_finite, segment_reduce

__all__ = [
    "FixedPlan", "decode_accumulate", "encode_uniform_fast", "fixed_plan", "inverse_norms", "quantize_uniform_fast",
    "read_header", "segment_starts",
]

MIN_CHUNKS_PER_THREAD = 64  # 256K coordinates: below that a thread costs more than it saves


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
        scales = max_norms(flat, starts)
    s = levels_for_bits(bits)
    return flat, starts, torch.from_numpy(scales), inverse_norms(scales, s), s


def max_norms(flat: torch.Tensor, starts: np.ndarray) -> np.ndarray:
    """max |x| per segment (float32) of a non-empty ``flat``, on one thread below
    ``2·MIN_CHUNKS_PER_THREAD`` chunks (where ``run_split`` would make one range anyway)."""
    n, xb = flat.numel(), flat.numpy().view(np.int32)
    if n < 2 * MIN_CHUNKS_PER_THREAD * fused.CHUNK:
        scales = fused.absmax_range(xb, starts, 0, n).view(np.float32)
    else:
        parts = run_split(fused.absmax_range, n, xb, starts, min_per_thread=MIN_CHUNKS_PER_THREAD * fused.CHUNK)
        scales = np.maximum.reduce(parts).view(np.float32)  # max of the bits = the bits of the max
    return scales  # max |x| is NaN or Inf exactly when some x_i is: inverse_norms refuses it


def inverse_norms(scales: np.ndarray, levels: int) -> np.ndarray:
    """s/norm per segment (0 for a zero norm), float32: the values of quantize_uniform's
    ``torch.where(sc > 0, s / sc, 0)`` (so every code is bit-identical), in one compiled call
    (:func:`dqsgd.kernels.fused.inverse_norms`) instead of three torch ones.

    Raises:
      NonFiniteGradientError: a norm is NaN or Inf (the input held NaN or Inf).
      ValueError: a norm so small that s/norm overflows float32 (quantize_uniform shares this
        limit: its codes come out invalid).
    """
    inv = np.empty(scales.size, dtype=np.float32)
    status = fused.inverse_norms(scales, np.float32(levels), inv)
    if status == 1:
        raise NonFiniteGradientError(
            f"fused uniform quantizer: input contains NaN or Inf (non-finite norm {scales.tolist()[:4]}); "
            "refusing to quantize")
    if status == 2:
        r = float(scales[~np.isfinite(inv)][0])
        raise ValueError(f"fused uniform quantizer: a segment norm of {r:.3g} is too small: s/norm = {levels}/{r:.3g} "
                         "overflows float32 (norms must be 0 or above s·2^-128)")
    return inv


def _args(flat, starts, inv, s, bits, rng):
    return (flat.numpy(), starts, inv, np.float32(s), bits == 1, np.uint64(rng.key))


def quantize_uniform_fast(x: torch.Tensor, bits: int, rng: HashRNG, *, norm: Norm = Norm.MAX,
                          layout: Layout = Layout()) -> Quantized:
    """The fused quantizer's codes and scales (what :func:`encode_uniform_fast` packs)."""
    return _quantize(x, bits, rng, norm, layout, histogram=False)[0]


def _quantize(x: torch.Tensor, bits: int, rng: HashRNG, norm: Norm, layout: Layout,
              histogram: bool) -> tuple[Quantized, np.ndarray | None]:
    """:func:`quantize_uniform_fast`, and with ``histogram`` the codes'
    :func:`~dqsgd.codecs.rans.level_histogram`, counted in the quantizing pass (else None)."""
    flat, starts, scales, inv, s = _prepare(x, bits, norm, layout)
    n = flat.numel()
    codes = np.empty(n, dtype=np.int32)
    nsym = 1 << bits if histogram else 0
    hist = np.zeros(nsym, dtype=np.int64)
    if n:
        parts = run_split(fused.codes_range, -(-n // fused.CHUNK), *_args(flat, starts, inv, s, bits, rng), codes,
                          0 if bits == 1 else 1 << (bits - 1), nsym, min_per_thread=MIN_CHUNKS_PER_THREAD)
        hist = np.sum(parts, axis=0) if len(parts) > 1 else parts[0]
    q = Quantized(Scheme.UNIFORM, bits, s, torch.from_numpy(codes), scales, layout, tuple(x.shape), norm, dtype=x.dtype)
    return q, hist if histogram else None


_PACKED = (Coding.FIXED, Coding.ZSTD, Coding.ZSTD_ALIGNED)  # codings the fused kernel packs itself
_CODES_FIRST = (Coding.ELIAS, Coding.RANS, Coding.RANSX)  # codings decode-accumulate decodes to codes first
_CODING_AT = 5  # the header's coding byte: magic "DQ", version, scheme, bits, coding


def encode_uniform_fast(x: torch.Tensor, bits: int, rng: HashRNG, *, norm: Norm = Norm.MAX,
                        layout: Layout = Layout(), coding: Coding = Coding.FIXED, link_mbit: float = 0.0) -> bytes:
    """The payload of the hash-RNG stochastic uniform quantizer of ``x`` at ``bits`` (1..16):
    ``encode(quantize_uniform_fast(x, …), coding, link_mbit=link_mbit)``, byte for byte.

    FIXED, ZSTD and ZSTD_ALIGNED are packed in the fused kernel (straight into the payload for
    FIXED); ELIAS, RANS, RANSX and AUTO go through the codes and :func:`dqsgd.codecs.encode`
    (entropy coders need the histogram of all codes first), the histogram counted in the
    quantizing pass, which also stands for the encoder's check of the codes' range (one walk
    over the codes fewer for each).

    Raises:
      NonFiniteGradientError: ``x`` has NaN or Inf (nothing is encoded).
      ValueError: bits outside 1..16, a bad norm, layout or coding.
    """
    coding = Coding(coding)
    if coding not in _PACKED:
        q, hist = _quantize(x, bits, rng, norm, layout, histogram=True)
        payload = encode_payload(q, coding, link_mbit=link_mbit, histogram=hist)
        if Coding(payload[_CODING_AT]) in _CODES_FIRST:  # its decoder would rebuild these codes: keep them
            recent.remember(payload, q.codes.numpy())
        return payload
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
      PayloadError: whatever ``decode`` refuses, and values ``w·x̂`` that would not be finite
        (:mod:`dqsgd.quantizers.base`: refused before anything is added). Body errors (codes out
        of range) are found while accumulating: ``out`` then holds a partial sum and must be discarded.
      ValueError: ``out`` is not a contiguous float32 CPU buffer of the payload's numel.
    """
    h = header if header is not None else read_header(payload, max_numel=max_numel)
    arr = _out_array(out, h.numel)
    buf = memoryview(payload).cast("B")
    w = np.float32(weight)
    if h.scheme not in RAW_SCHEMES and h.numel:
        _refuse_beyond(step_bound(_steps(h), top_code(h.scheme, h.bits, h.levels), weight), h,
                       segment_starts(h.layout, h.numel))
    rng = wire.code_range(h.scheme, h.bits, h.levels)
    if (h.coding in (Coding.ELIAS, Coding.RANS, Coding.RANSX) or h.numel == 0
            or (h.scheme not in RAW_SCHEMES and not rng.zero_ok and h.bits > 1)):
        # ELIAS, RANS (and SIGN codes wider than 1 bit, which must not be 0): the validated codes first;
        # RANSX's last check (its table is the codes' normalised counts) counts them while they are added.
        data = recent.recall(buf) if h.coding in _CODES_FIRST else None  # a payload this process encoded
        check = None
        if data is None:
            data, check = wire.decode_body_uncounted(buf, h)
        if h.numel:
            starts, steps = segment_starts(h.layout, h.numel), _steps(h)
            if check is None:
                fused.accumulate_codes(data, starts, steps, w, arr)
            else:
                check(fused.accumulate_codes_counted(data, starts, steps, w, arr, 0 if h.bits == 1 else
                                                     1 << (h.bits - 1), h.bits == 1, 1 << h.bits))
        return h
    body = buf[h.body_start : h.body_start + h.body_len]
    width = wire.body_width(h.bits, h.coding)
    if h.coding in (Coding.ZSTD, Coding.ZSTD_ALIGNED):
        body = wire.unzstd(body, packed_size(h.numel, width), h.body_start)
    _check_fixed_body(body, h, width)
    data = np.frombuffer(body, dtype=np.uint8)
    chunks = -(-h.numel // fused.CHUNK)
    if h.scheme in RAW_SCHEMES:
        values = data.view("<f4")
        _refuse_beyond(np.abs(w * np.array([values.min(), values.max()], dtype=np.float32)), h)
        run_split(fused.accumulate_values, chunks, values, w, arr, min_per_thread=MIN_CHUNKS_PER_THREAD)
        return h
    bits, starts = h.bits, segment_starts(h.layout, h.numel)
    offset = 0 if bits == 1 else 1 << (bits - 1)
    spans = run_split(fused.accumulate_range, chunks, data, width, offset, bits == 1, starts, _steps(h), w, arr,
                      min_per_thread=MIN_CHUNKS_PER_THREAD)
    _check_code_spans(spans, (rng.lo, rng.hi), h.body_start)
    return h


def _check_code_spans(spans: list[tuple[int, int]], allowed: tuple[int, int], body_start: int) -> None:
    """Refuse codes outside the scheme's range ``allowed`` = (lo, hi), from the (min, max) that each
    accumulated range saw (1-bit codes are ±1 by construction: never 0)."""
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    if lo < allowed[0] or hi > allowed[1]:
        raise PayloadError(
            f"body at offset {body_start}: codes span [{lo}, {hi}], the scheme allows [{allowed[0]}, {allowed[1]}]")


def _refuse_beyond(bound: np.ndarray, h: Header, starts: np.ndarray | None = None) -> None:
    """The finite-output rule (:mod:`dqsgd.quantizers.base`) for a float32 accumulator, before
    anything is added: ``bound`` holds the largest |w·x̂| (per segment of ``starts``, where a
    segment with no coordinate decodes nothing; NaN: a NaN value)."""
    if starts is not None and h.layout.sizes is not None:
        bound = np.where(np.diff(starts) > 0, bound, np.float32(0))
    if (why := overflow(float(bound.max(initial=0.0)), torch.float32, f"{h.scheme.name} payload")) is not None:
        raise PayloadError(why)


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


# ------------------------------------------------------------------------ fixed-shape payloads


class FixedPlan:
    """Everything a FIXED uniform payload of a float32 vector of ``numel`` elements at ``bits``
    with ``norm`` and ``layout`` has in common, computed once.

    A caller that sends payloads of the same shape every step (the DDP hook's shards) pays the
    validation of its arguments, the segment starts, the header bytes and the sizes once, instead
    of on every call: :meth:`encode_into` writes the payload of :func:`encode_uniform_fast` (the
    same bytes) into a caller's buffer, and :meth:`accumulate` decodes a payload whose header it
    knows in advance, comparing the header bytes with the expected ones instead of parsing them.
    The crc, the scales, the padding bits and the code range are still checked on every payload.
    """

    def __init__(self, numel: int, bits: int, norm: Norm, layout: Layout) -> None:
        check_bits(bits, 1, 16, "fused uniform quantizer")
        if norm not in (Norm.MAX, Norm.L2):
            raise ValueError(f"fused uniform quantizer: norm must be Norm.MAX or Norm.L2, got {norm!r}")
        if not 0 <= numel < 1 << 32:
            raise ValueError(f"fused uniform quantizer: {numel} elements, the wire carries < 2^32")
        wire.check_layout(layout, numel)
        self.numel, self.bits, self.norm, self.layout = numel, bits, norm, layout
        self.levels = levels_for_bits(bits)
        self.starts = segment_starts(layout, numel)
        nseg = self.starts.size - 1
        self.body_len = packed_size(numel, bits)
        head = write_header(Scheme.UNIFORM, bits, Coding.FIXED, norm, self.levels, (numel,), layout,
                            np.zeros(nseg, dtype=np.float32), self.body_len)
        self.head_len = len(head)
        self.scales_at = self.head_len - 4 - 4 * nseg  # the scales, then the body length
        self.size = self.head_len + self.body_len + 4
        self.template = np.frombuffer(head, dtype=np.uint8).copy()  # zero scales
        self._fixed = head[: self.scales_at] + head[-4:]  # the header bytes no payload changes
        self._offset = 0 if bits == 1 else 1 << (bits - 1)
        self._chunks = -(-numel // fused.CHUNK)
        self._split = self._chunks >= 2 * MIN_CHUNKS_PER_THREAD  # below that run_split runs one range
        self._range = wire.code_range(Scheme.UNIFORM, bits, self.levels)

    # --------------------------------------------------------------------------------- encode

    def encode_into(self, x: torch.Tensor, rng: HashRNG, out: np.ndarray) -> None:
        """Write ``encode_uniform_fast(x, bits, rng, norm=norm, layout=layout)`` into ``out``.

        ``x``: a float32 CPU tensor of ``numel`` elements (any shape, read flat; the payload's
        shape is ``(numel,)``); ``out``: a writable uint8 array of :attr:`size` bytes.

        Raises:
          NonFiniteGradientError: ``x`` has NaN or Inf (``out`` then holds no valid payload).
          ValueError: a wrong ``x`` or ``out``, or a norm so small that s/norm overflows.
        """
        flat = self._flat(x)
        if out.dtype != np.uint8 or out.shape != (self.size,):
            raise ValueError(f"out must be a uint8 array of {self.size} bytes, got {out.dtype} {out.shape}")
        scales = self._scales(flat)
        inv = inverse_norms(scales, self.levels)
        head = self.head_len
        out[:head] = self.template
        out[self.scales_at : head - 4] = scales.view(np.uint8)
        if self.numel:
            body = out[head : head + self.body_len]
            args = (flat.numpy(), self.starts, inv, np.float32(self.levels), self.bits == 1, np.uint64(rng.key),
                    self.bits, self._offset, body)
            self._run(fused.encode_range, *args)
        out[-4:] = np.array([crc32(out[:-4])], dtype="<u4").view(np.uint8)

    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() != self.numel:
            raise ValueError(f"x must be a float32 CPU tensor of {self.numel} elements, "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
        return x.detach().reshape(-1).contiguous()

    def _run(self, fn, *args):  # noqa: ANN001, ANN202 - a compiled kernel and its arguments
        """``fn`` over every chunk: on this thread when run_split would use one range anyway."""
        if not self._split:
            return [fn(*args, 0, self._chunks)]
        return run_split(fn, self._chunks, *args, min_per_thread=MIN_CHUNKS_PER_THREAD)

    def _scales(self, flat: torch.Tensor) -> np.ndarray:
        """Per-segment norms, the floats :func:`encode_uniform_fast` computes."""
        if self.norm == Norm.L2:  # torch's own l2 (summation order matters for bit-identical scales)
            scales = segment_reduce(flat, self.layout, "l2").numpy().astype(np.float32)
            require_finite(torch.from_numpy(scales), "fused uniform quantizer")
            return scales
        if not self.numel:
            return np.zeros(self.starts.size - 1, dtype=np.float32)
        return max_norms(flat, self.starts)

    # --------------------------------------------------------------------------------- decode

    def matches(self, payload: np.ndarray) -> bool:
        """Whether ``payload`` has this plan's size and header bytes (the scales aside)."""
        head = self.head_len
        return (payload.size == self.size
                and payload[: self.scales_at].tobytes() + payload[head - 4 : head].tobytes() == self._fixed)

    def accumulate(self, payload: np.ndarray, out: torch.Tensor | np.ndarray, weight: float = 1.0) -> Header:
        """``out += weight · x̂`` of a payload of this plan: the sum :func:`decode_accumulate` makes;
        returns the payload's header, as it does.

        ``payload``: a uint8 array. One whose size or header bytes differ from this plan's is
        parsed to say what is wrong with it, and refused.

        Raises:
          PayloadError: another size or header (what :func:`read_header` says of it, else the
            difference), a crc mismatch, a non-finite scale or values (:func:`decode_accumulate`),
            non-zero padding bits or codes out of range (found while accumulating: ``out`` then
            holds a partial sum and must be discarded).
        """
        if not self.matches(payload):
            h = read_header(payload, max_numel=max(self.numel, 1))
            raise PayloadError(f"expected a uniform FIXED payload of {self.numel} values at {self.bits} bits, "
                               f"{self.norm.name} norm, {self.layout}; got {h.scheme.name} {h.coding.name} of "
                               f"{h.numel} values at {h.bits} bits, {h.norm.name} norm, {h.layout}")
        arr = _out_array(out, self.numel)
        wire.check_crc(memoryview(payload).cast("B"))
        scales = payload[self.scales_at : self.head_len - 4].view("<f4").astype(np.float32)
        if not np.isfinite(scales).all():
            raise PayloadError(f"non-finite scale in the scales at offset {self.scales_at}")
        header = Header(Scheme.UNIFORM, self.bits, Coding.FIXED, self.norm, self.levels, (self.numel,), self.layout,
                        scales, self.head_len, self.body_len)
        if not self.numel:
            return header
        body = payload[self.head_len : self.head_len + self.body_len]
        _check_fixed_body(body, header, self.bits)
        steps = scales / np.float32(self.levels)  # float32 division, the floats of ``_steps``
        _refuse_beyond(step_bound(steps, top_code(Scheme.UNIFORM, self.bits, self.levels), weight), header,
                       self.starts)
        spans = self._run(fused.accumulate_range, body, self.bits, self._offset, self.bits == 1, self.starts, steps,
                          np.float32(weight), arr)
        _check_code_spans(spans, (self._range.lo, self._range.hi), self.head_len)
        return header


@functools.lru_cache(maxsize=1024)
def fixed_plan(numel: int, bits: int, norm: Norm, layout: Layout) -> FixedPlan:
    """The :class:`FixedPlan` of (numel, bits, norm, layout), built once per process."""
    return FixedPlan(numel, bits, norm, layout)
