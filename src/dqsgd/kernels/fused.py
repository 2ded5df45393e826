"""Compiled (numba) loops of the fused stochastic uniform quantizer: no full-size temporaries.

The tensor is processed in chunks of ``CHUNK`` coordinates (a multiple of 8, so every chunk
starts on a byte boundary of the packed stream at any width). Per chunk, its uniforms and its
codes live in two small buffers that stay in L1; the codes are packed by the project's one
packer (``dqsgd.codecs.bitpack``'s compiled kernels, called on the chunk) straight into the
payload, and decoding unpacks a chunk the same way and adds ``w·x̂`` into the running sum.

Arithmetic is float32 and in the same order as ``dqsgd.quantizers.uniform`` (no fast-math, so
no FMA contraction), which is what makes the fused payload bit-identical to the torch-ops
quantizer fed the same hash uniforms, and the decode-accumulate sum bit-identical to
``Σ dequantize``.

``starts`` is int64 of length nseg + 1: segment k covers ``[starts[k], starts[k+1])``.
Functions named ``*_range`` do chunks (or, for the norm, coordinates) ``[lo, hi)``: the unit that
:func:`dqsgd.codecs.threads.run_split` hands to each thread. They release the GIL (``nogil``) and
are run by a plain thread pool, not numba's ``prange``: ``prange`` over 2 threads was 1.3-40x
*slower* than one thread on a 2-core machine busy with other processes (an OpenMP barrier spins on a descheduled
core) and added 25 s of compile time. Every chunk's codes depend only on the key and the
coordinate index, and every output coordinate is written by exactly one thread, so the payload
and the decoded sums are the same bits at any thread count.
"""

from __future__ import annotations

import numpy as np
from numba import literal_unroll, njit

from dqsgd.codecs.bitpack import pack_aligned, pack_pow2, pack_small, pack_stream
from dqsgd.codecs.bitpack import unpack_aligned, unpack_pow2, unpack_small, unpack_stream
from dqsgd.kernels.hashrng import fill_hashes, to_uniform

CHUNK = 4096  # a multiple of 8 (byte boundaries at every width) and of 4 (one hash per 4 coordinates)
_POW2 = (1, 2, 4, 8)  # widths that get their own specialised copy of bitpack's kernels
_ODD = (3, 5, 6, 7)
_ABS_MASK = np.int32(0x7FFFFFFF)
_ONE = np.float32(1.0)
_HALF = np.float32(0.5)


# ------------------------------------------------------------------------------ norm (pass 1)


@njit(cache=True, nogil=True)
def _absmax_bits(xb, lo, hi):  # pragma: no cover - compiled
    """max over [lo, hi) of the float32 bit patterns with the sign cleared (``xb`` = x as int32).

    For IEEE floats without sign, integer order is magnitude order, and every NaN (> 0x7F800000)
    and Inf (= 0x7F800000) lies above every finite value: an integer max — which vectorizes,
    unlike a NaN-aware float max — gives max |x| and detects non-finite input in one pass.
    """
    m = np.int32(0)
    seg = xb[lo:hi]
    for i in range(seg.size):  # from 0: see _quantize_piece
        v = np.int32(seg[i] & _ABS_MASK)  # kept int32: a widened max does not vectorize (5x)
        if v > m:
            m = v
    return m


@njit(cache=True, nogil=True)
def absmax_range(xb, starts, lo, hi):  # pragma: no cover - compiled
    """out[k] = the bits of max |x| over segment k ∩ [lo, hi) (0 if empty; see ``_absmax_bits``)."""
    out = np.zeros(starts.size - 1, np.int32)
    k = np.searchsorted(starts, lo, side="right") - 1
    i = lo
    while i < hi:
        while starts[k + 1] <= i:  # also skips empty segments
            k += 1
        e = min(hi, starts[k + 1])
        out[k] = max(out[k], _absmax_bits(xb, i, e))
        i = e
    return out


@njit(cache=True, nogil=True)
def inverse_norms(scales, levels, inv):  # pragma: no cover - compiled
    """inv[k] = (1 / scales[k]) · levels in float32 (0 where scales[k] is not > 0): torch's
    ``levels / sc`` is ``sc.reciprocal() * levels``, two roundings, and so is this (no fast-math:
    no contraction to one division). Returns 1 if a scale is NaN or Inf, else 2 if some inv
    overflows to Inf, else 0."""
    status = 0
    for k in range(scales.size):
        r = scales[k]
        if not np.isfinite(r):
            return 1
        v = (_ONE / r) * levels if r > 0 else np.float32(0.0)
        if not np.isfinite(v):
            status = 2
        inv[k] = v
    return status


# ------------------------------------------------------------------------- quantize (pass 2)


@njit(cache=True, inline="always")
def _quantize_piece(x, i0, t0, t1, inv, sf, one_bit, fields, cbuf):  # pragma: no cover - compiled
    """cbuf[t] for t in [t0, t1): the code of x[i0 + t] (1 bit: 1 for +1, 0 for −1), with the
    uniform of 16-bit field ``fields[t]`` (:func:`dqsgd.kernels.hashrng.to_uniform`).

    The loops run over slices from 0: with an index of unknown sign numba adds a negative-index
    wrap-around to every access, which stops vectorization (2x slower, measured).
    """
    xs, us, cs = x[i0 + t0 : i0 + t1], fields[t0:t1], cbuf[t0:t1]
    if one_bit:
        for t in range(xs.size):
            v = min(max(xs[t] * inv, -_ONE), _ONE)
            cs[t] = np.int32(to_uniform(us[t]) < (v + _ONE) * _HALF)
    else:
        for t in range(xs.size):  # float32 throughout, converted once: this form vectorizes (3x)
            v = xs[t]
            a = min(abs(v) * inv, sf)
            low = np.floor(a)
            q = min(low + np.float32(to_uniform(us[t]) < a - low), sf)
            cs[t] = np.int32(-q if v < 0 else q)


@njit(cache=True, inline="always")
def _quantize_chunk(x, i0, m, seg, starts, inv, sf, one_bit, key, hbuf, cbuf):  # pragma: no cover
    """Codes of x[i0 : i0+m] into cbuf[:m]; returns the segment of the last coordinate."""
    fill_hashes(key, i0, m, hbuf)
    fields = hbuf.view(np.uint16)
    t = 0
    while t < m:
        while starts[seg + 1] <= i0 + t:  # also skips empty segments
            seg += 1
        t1 = min(m, starts[seg + 1] - i0)
        _quantize_piece(x, i0, t, t1, inv[seg], sf, one_bit, fields, cbuf)
        t = t1
    return seg


@njit(cache=True, inline="always")
def pack_chunk(cbuf, m, i0, width, offset, out):  # pragma: no cover - compiled
    """bitpack's kernels on one chunk: values i0 … i0+m−1 of the stream (i0 a multiple of 8).

    Widths 1..8 call the kernel with a *constant* width, so LLVM inlines and specialises
    bitpack's one implementation per width (2-3x faster than a run-time width, measured); the
    bit-serial stream kernel of widths 9..15 gains nothing from it and is called as is. The
    range check is off: the codes are clamped to ±s < 2^(b−1), so every one fits its field
    (and the tests compare the payload with the checked packer's).
    """
    codes = cbuf[:m]
    dst = out[i0 * width // 8 :]
    if width == 16:
        pack_aligned(codes, 16, offset, dst, False)
        return
    done = 0
    for w in literal_unroll(_POW2):
        if width == w:
            done = (m // (8 // w)) * (8 // w)
            pack_pow2(codes, w, offset, dst, False)
    for w in literal_unroll(_ODD):
        if width == w:
            done = (m // 8) * 8
            pack_small(codes, w, offset, dst, False)
    if done < m:  # widths 9..15, and the last values of a short final chunk
        pack_stream(codes, done, width, offset, dst, done * width // 8)


@njit(cache=True, nogil=True)
def encode_range(x, starts, inv, sf, one_bit, key, width, offset, out, c_lo, c_hi):  # pragma: no cover
    """Quantize chunks [c_lo, c_hi) and pack them at ``width`` (offset binary) into the body ``out``."""
    n = x.size
    hbuf = np.empty(CHUNK // 4, np.uint64)
    cbuf = np.empty(CHUNK, np.int32)
    seg = np.searchsorted(starts, c_lo * CHUNK, side="right") - 1
    for c in range(c_lo, c_hi):
        i0 = c * CHUNK
        m = min(CHUNK, n - i0)
        seg = _quantize_chunk(x, i0, m, seg, starts, inv, sf, one_bit, key, hbuf, cbuf)
        pack_chunk(cbuf, m, i0, width, offset, out)


@njit(cache=True, nogil=True)
def codes_range(x, starts, inv, sf, one_bit, key, codes, offset, nsym, c_lo, c_hi):  # pragma: no cover
    """Signed codes (±1 at one bit) of chunks [c_lo, c_hi) into ``codes``; with ``nsym`` > 0, in the
    same pass, the counts of their offset-binary symbols (``u = c + offset``; 1 bit: ``u = 1`` for
    +1), each chunk counted while it is still in L1 (:func:`_count`). Returns the counts (int64,
    ``nsym`` of them; none for ``nsym`` = 0)."""
    n = x.size
    hbuf = np.empty(CHUNK // 4, np.uint64)
    cbuf = np.empty(CHUNK, np.int32)  # quantized here, then copied: rounding straight into ``codes``,
    part = np.zeros((4, nsym), np.int64)  # which may alias ``x`` for all the compiler knows, does not vectorize (2x)
    seg = np.searchsorted(starts, c_lo * CHUNK, side="right") - 1
    for c in range(c_lo, c_hi):
        i0 = c * CHUNK
        m = min(CHUNK, n - i0)
        seg = _quantize_chunk(x, i0, m, seg, starts, inv, sf, one_bit, key, hbuf, cbuf)
        src = cbuf[:m]
        if one_bit:
            for t in range(m):
                src[t] = 2 * src[t] - 1
        codes[i0 : i0 + m] = src
        if nsym:
            _count(src, offset, one_bit, part)
    return _summed(part)


@njit(cache=True, inline="always")
def _count(codes, offset, one_bit, part):  # pragma: no cover - compiled
    """part[i mod 4, u_i] += 1: four partial histograms, since consecutive codes are mostly the same
    level and one histogram would chain every increment on the one before."""
    n4 = codes.size // 4 * 4
    for t in range(0, n4, 4):
        for k in range(4):  # unrolled: the row of each increment is a constant
            c = np.int64(codes[t + k])
            part[k, np.int64(c > 0) if one_bit else c + offset] += 1
    for t in range(n4, codes.size):
        c = np.int64(codes[t])
        part[0, np.int64(c > 0) if one_bit else c + offset] += 1


@njit(cache=True, inline="always")
def _summed(part):  # pragma: no cover - compiled
    hist = part[0].copy()
    for k in range(1, part.shape[0]):
        hist += part[k]
    return hist


# -------------------------------------------------------------------------- decode-accumulate


@njit(cache=True, inline="always")
def _unpack_chunk(body, i0, m, width, offset, cbuf):  # pragma: no cover - compiled
    """Inverse of ``pack_chunk`` (constant widths for the same reason)."""
    src = body[i0 * width // 8 :]
    dst = cbuf[:m]
    if width == 16:
        unpack_aligned(src, 16, m, offset, dst)
        return
    done = 0
    for w in literal_unroll(_POW2):
        if width == w:
            done = (m // (8 // w)) * (8 // w)
            unpack_pow2(src, w, m, offset, dst)
    for w in literal_unroll(_ODD):
        if width == w:
            done = (m // 8) * 8
            unpack_small(src, w, m, offset, dst)
    if done < m:
        unpack_stream(src[: (m * width + 7) // 8], done, width, m, offset, dst)


@njit(cache=True, inline="always")
def _add_piece(cbuf, i0, t0, t1, st, w, out):  # pragma: no cover - compiled
    """out[i0+t] += w·(c_t·st); returns (min c, max c) of the piece (a zero count would stop
    the loop from vectorizing, 6x: the caller handles the one scheme that forbids zeros)."""
    lo = np.int32(0x7FFFFFFF)
    hi = np.int32(-0x7FFFFFFF)
    cs, os = cbuf[t0:t1], out[i0 + t0 : i0 + t1]
    for t in range(cs.size):  # from 0: see _quantize_piece
        c = cs[t]
        lo = min(lo, c)
        hi = max(hi, c)
        os[t] += w * (np.float32(c) * st)
    return lo, hi


@njit(cache=True, nogil=True)
def accumulate_range(body, width, offset, one_bit, starts, step, w, out, c_lo, c_hi):  # pragma: no cover
    """Chunks [c_lo, c_hi) of a FIXED body into ``out``; returns (min code, max code)."""
    n = out.size
    cbuf = np.empty(CHUNK, np.int32)
    seg = np.searchsorted(starts, c_lo * CHUNK, side="right") - 1
    lo, hi = np.int32(0x7FFFFFFF), np.int32(-0x7FFFFFFF)
    for c in range(c_lo, c_hi):
        i0 = c * CHUNK
        m = min(CHUNK, n - i0)
        _unpack_chunk(body, i0, m, width, offset, cbuf)
        if one_bit:
            for t in range(m):
                cbuf[t] = 2 * cbuf[t] - 1
        t = 0
        while t < m:
            while starts[seg + 1] <= i0 + t:
                seg += 1
            t1 = min(m, starts[seg + 1] - i0)
            plo, phi = _add_piece(cbuf, i0, t, t1, step[seg], w, out)
            lo, hi = min(lo, plo), max(hi, phi)
            t = t1
    return lo, hi


@njit(cache=True, nogil=True)
def accumulate_codes(codes, starts, step, w, out):  # pragma: no cover - compiled
    """out += w·(codes·step[seg]) for already-decoded int32 codes (ELIAS bodies)."""
    for k in range(starts.size - 1):
        st = step[k]
        cs, os = codes[starts[k] : starts[k + 1]], out[starts[k] : starts[k + 1]]
        for i in range(cs.size):
            os[i] += w * (np.float32(cs[i]) * st)


@njit(cache=True, nogil=True)
def accumulate_codes_counted(codes, starts, step, w, out, offset, one_bit, nsym):  # pragma: no cover - compiled
    """:func:`accumulate_codes`, and the counts of the codes' offset-binary symbols (as
    :func:`codes_range`'s), each chunk of ``CHUNK`` codes counted right after it is added,
    while it is in L1. ``codes``: within ``[−offset, nsym − offset)`` (the rANS decoders' table
    symbols). Returns the counts."""
    part = np.zeros((4, nsym), np.int64)
    seg = 0
    for c0 in range(0, codes.size, CHUNK):
        c1 = min(codes.size, c0 + CHUNK)
        i = c0
        while i < c1:
            while starts[seg + 1] <= i:  # also skips empty segments
                seg += 1
            e = min(c1, starts[seg + 1])
            st = step[seg]
            cs, os = codes[i:e], out[i:e]
            for t in range(cs.size):  # from 0: see _quantize_piece
                os[t] += w * (np.float32(cs[t]) * st)
            i = e
        _count(codes[c0:c1], offset, one_bit, part)
    return _summed(part)


@njit(cache=True, nogil=True)
def accumulate_values(values, w, out, c_lo, c_hi):  # pragma: no cover - compiled
    """out += w·values over chunks [c_lo, c_hi) (IDENTITY bodies, read in place from the payload)."""
    lo, hi = c_lo * CHUNK, min(c_hi * CHUNK, out.size)
    vs, os = values[lo:hi], out[lo:hi]
    for i in range(os.size):
        os[i] += w * vs[i]
