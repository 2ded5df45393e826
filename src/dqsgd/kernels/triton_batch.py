"""The Triton kernels of the batched codec (:mod:`dqsgd.kernels.batch`): each pass is ONE launch for
every payload of a batch, a grid of (blocks, payloads).

Program (i, p) does block i of payload p with the one-payload kernels' own code
(:mod:`dqsgd.kernels.triton_codec`: ``write_head``, ``encode_groups``; :mod:`dqsgd.kernels.triton_decode`:
``decode_groups``; :mod:`dqsgd.kernels.triton_crc`: the crc's levels), reading payload p's numbers (where its input, its
scales and its bytes lie, its header) from one int64 table (``_meta``, built once per batch and
device): the same bytes and sums as one call per payload. A block past a shorter payload's end is
masked off, as the last block of one payload is.

* norm: one launch (``_absmax_batch``: per-segment integer max of the bit patterns, atomics; exact
  in any order);
* encode: one launch, headers and bodies (``_encode_batch``); then the crc, one launch per level of
  its tree for all payloads (``_crc_batch``; one level up to 2 KiB per payload): every payload's
  stream is padded in front to the longest's blocks (leading zero bytes leave the crc's raw value
  unchanged), so all have the same tree;
* decode: the crc check (which starts every payload's stats and copies its scales), then one launch
  (``_decode_batch``) whose program (i, t) adds block i of the R payloads of target t in their order
  (the W payloads of a shard: one target; the S shards of a downlink: S targets of one payload), so
  every coordinate receives its payloads in order without atomics; the sum is held in registers and
  written once (``fresh``: without reading ``out`` first). Every check ORs into ``bad``.

The checks are deferred (the hook's no-sync path): a non-finite shard or a too small norm writes a
NaN scale, which every decoder refuses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from dqsgd.codecs import wire
from dqsgd.kernels.device_crc import crc32_length_constant
from dqsgd.kernels.hashrng import signed64
from dqsgd.kernels.triton_codec import BLOCK, GROUPS, HB, body_log, encode_program, mix64_triton, pow2, segment_span
from dqsgd.kernels.triton_crc import FAN, ROWS, block_table_on, crc_raw, crc_verdict, level0_blocks, tables_on
from dqsgd.kernels.triton_decode import STATS, decode_groups
from dqsgd.kernels.workspace import scratch, step_key
from dqsgd.quantizers import Norm, Scheme

if TYPE_CHECKING:
    from dqsgd.kernels.batch import Batch

__all__ = ["accumulate_batch_triton", "encode_batch_triton", "split_keys", "unmix64"]

# the columns of a batch's table: input (or out) offset, numel, segments, first scale, first segment
# start, payload offset, header length, scales' offset in the header, template offset, body length,
# payload length, the crc's length constant
X, N, NSEG, SEG, ST, P, K, SCALE, H, NB, LEN, KC = range(12)
F = 12
GAP = 8  # the most bytes after a payload the crc's last level zeroes (the hook's gap: 1, its flag byte)


@triton.jit
def _absmax_batch(x_ptr, out_ptr, starts_ptr, meta_ptr, bucket, BLOCK: tl.constexpr, MODE: tl.constexpr,
                  STEPS: tl.constexpr):
    """out[SEG + k] = the bits of max |x| over segment k of payload p = program_id(1) (out starts at 0)."""
    m = meta_ptr + tl.program_id(1) * 12
    n, nseg = tl.load(m + 1), tl.load(m + 2)
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    x = tl.load(x_ptr + tl.load(m) + idx, mask=ok, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    seg = segment_span(idx, ok, starts_ptr + tl.load(m + 4), nseg, bucket, MODE, STEPS)
    out = out_ptr + tl.load(m + 3)
    first = tl.min(tl.where(ok, seg, nseg), axis=0)
    last = tl.max(tl.where(ok, seg, -1), axis=0)
    if first == last:  # the block in one segment: one atomic
        tl.atomic_max(out + first, tl.max(bits, axis=0))
    else:
        tl.atomic_max(out + seg, bits, mask=ok)


@triton.jit(do_not_specialize=["blocks", "raw_at"])
def _encode_batch(x_ptr, scale_ptr, rec_ptr, starts_ptr, out_ptr, head_ptr, keys_ptr, meta_ptr, tab_ptr, raw_ptr,
                  raw_at, bucket, base_ptr, blocks, BITS: tl.constexpr, LEVELS: tl.constexpr, WB: tl.constexpr,
                  GROUPS: tl.constexpr, MODE: tl.constexpr, STEPS: tl.constexpr, HB: tl.constexpr,
                  BLOG: tl.constexpr):
    """Payload p = program_id(1): this program's header bytes and GROUPS·8 coordinates, and level 0 of
    their crc into raws[raw_at + p·blocks:] (every stream padded in front to ``blocks`` blocks), as
    ``_encode_kernel``; its key is mix64(base ⊕ keys[p]) (:func:`split_keys`), base read from ``base_ptr``."""
    s = tl.program_id(1)
    m = meta_ptr + s * 12
    seg0, pay = tl.load(m + 3), out_ptr + tl.load(m + 5)
    encode_program(x_ptr + tl.load(m), scale_ptr + seg0, rec_ptr + seg0, starts_ptr + tl.load(m + 4), pay,
                   head_ptr + tl.load(m + 8), pay, tab_ptr, raw_ptr + raw_at + s * blocks,
                   mix64_triton((tl.load(keys_ptr + s) ^ tl.load(base_ptr)).to(tl.uint64, bitcast=True)),
                   tl.load(m + 1),
                   tl.load(m + 9), tl.load(m + 2), bucket, tl.load(m + 6), tl.load(m + 7),
                   blocks * 2048 - (tl.load(m + 10) - 4), BITS, LEVELS, WB, GROUPS, MODE, STEPS, HB, False, BLOG)


@triton.jit(do_not_specialize=["src_at"])
def _crc_batch(src_ptr, src_at, tab_ptr, comb_ptr, raw_ptr, buf_ptr, stats_ptr, bad_ptr, copy_ptr, meta_ptr, count, programs,
               gap, ROWS: tl.constexpr, LEVEL0: tl.constexpr, FINAL: tl.constexpr, VERIFY: tl.constexpr,
               NSTATS: tl.constexpr, GAP: tl.constexpr):
    """One level of every payload's crc tree (``triton_crc._crc_level``), payload p = program_id(1):
    level 0 reads its bytes (all but the crc's 4) from the buffer, padded in front to ``programs``
    blocks; a level above reads its ``count`` raws of the level below. FINAL writes the crc into the
    payload and zeroes the ``gap`` (≤ GAP) bytes after it (so the encode's buffer needs no zero fill:
    every other byte is written by the encode), or (VERIFY) compares it with the stored one, starts
    the payload's stats and sets ``*bad`` on a mismatch; level 0 of a check also copies the
    payload's scales to ``copy_ptr`` (float32 aligned, at its first segment)."""
    p = tl.program_id(1)
    m = meta_ptr + p * 12
    g = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    q = tl.arange(0, 256)
    if LEVEL0:
        n = tl.load(m + 10) - 4
        src = src_ptr + tl.load(m + 5)
    else:
        n = count
        src = src_ptr + src_at + p * count
    i = g[:, None] * 256 + q[None, :] - (programs * 256 * ROWS - n)
    ok = (i >= 0) & (i < n)
    v = tl.load(src + i, mask=ok, other=0).to(tl.int32)
    if LEVEL0 and VERIFY:
        at, span = tl.load(m + 7), 4 * tl.load(m + 2)
        tl.store(copy_ptr + 4 * tl.load(m + 3) + (i - at), v.to(tl.uint8), mask=ok & (i >= at) & (i < at + span))
    raw = crc_raw(v, q, tab_ptr, comb_ptr, ROWS, 1 if LEVEL0 else 4)
    if FINAL:
        raw = raw ^ tl.load(m + 11).to(tl.int32)
        crc_verdict(raw, buf_ptr + tl.load(m + 5) + tl.load(m + 10) - 4, stats_ptr + p * NSTATS, bad_ptr,
                 2 if VERIFY else 0)
        if not VERIFY:
            j = tl.arange(0, GAP)
            tl.store(buf_ptr + tl.load(m + 5) + tl.load(m + 10) + j, tl.zeros((GAP,), tl.uint8), mask=j < gap)
    tl.store(raw_ptr + p * programs + tl.program_id(0), raw)


@triton.jit
def _decode_batch(buf_ptr, step_ptr, starts_ptr, out_ptr, stats_ptr, bad_ptr, head_ptr, meta_ptr, w, bucket, lo_ok,
                  hi_ok, zero_ok, R: tl.constexpr, BITS: tl.constexpr, WB: tl.constexpr, GROUPS: tl.constexpr,
                  MODE: tl.constexpr, STEPS: tl.constexpr, HB: tl.constexpr, NSTATS: tl.constexpr,
                  FRESH: tl.constexpr):
    """Target t = program_id(1): payloads t·R … t·R + R − 1 (all added at payload t·R's place), each
    decoded and checked as ``_decode_kernel`` (checks into its stats and ``*bad``), their terms summed
    in registers in payload order, acc = acc + w·(c·step) (the order and roundings of one add per
    payload), and the sums written once: one read (none with FRESH: acc starts at +0.0, what a zeroed
    ``out`` holds) and one write of the target's slice of ``out``, whatever R."""
    m0 = meta_ptr + tl.program_id(1) * R * 12
    dst = out_ptr + tl.load(m0)
    g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    idx = g[:, None] * 8 + tl.arange(0, 8)[None, :]
    seen = idx < 0
    if FRESH:
        acc = tl.zeros((GROUPS, 8), tl.float32)
    else:
        most = tl.load(m0 + 1)
        for r in range(1, R):
            most = tl.maximum(most, tl.load(m0 + r * 12 + 1))
        acc = tl.load(dst + idx, mask=idx < most, other=0.0)
    for r in range(0, R):
        p = tl.program_id(1) * R + r
        m = meta_ptr + p * 12
        n, nseg, k, pay = tl.load(m + 1), tl.load(m + 2), tl.load(m + 6), buf_ptr + tl.load(m + 5)
        term, _, ok = decode_groups(pay + k, step_ptr + tl.load(m + 3), starts_ptr + tl.load(m + 4),
                                    stats_ptr + p * NSTATS, bad_ptr, pay, head_ptr + tl.load(m + 8), w, n,
                                    tl.load(m + 9), nseg, bucket, k, tl.load(m + 7), (n * BITS) % 8, lo_ok, hi_ok,
                                    zero_ok, BITS, WB, GROUPS, MODE, STEPS, True, HB, True)
        acc = tl.where(ok, acc + term, acc)
        seen = seen | ok
    tl.store(dst + idx, acc, mask=seen)


# ------------------------------------------------------------------------------------ host side

_TABLES: dict[tuple[int, str], tuple[torch.Tensor, ...]] = {}


def _tables(b: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(meta, templates, segment starts) of batch ``b`` on ``device``, copied once."""
    key = (id(b), str(device))
    if key not in _TABLES:
        if len(_TABLES) > 256:
            _TABLES.clear()
        plans, a = b.plans, b.arrays
        meta = np.zeros((len(plans), F), dtype=np.int64)
        meta[:, X], meta[:, N] = a["out_at"], a["numels"]
        meta[:, NSEG], meta[:, SEG], meta[:, ST] = np.diff(a["seg_at"]), a["seg_at"][:-1], a["starts_at"][:-1]
        meta[:, P], meta[:, K] = a["at"], [p.head_len for p in plans]
        meta[:, SCALE], meta[:, H] = [p.scales_at for p in plans], np.cumsum([0] + [p.head_len for p in plans])[:-1]
        meta[:, NB], meta[:, LEN] = a["body_len"], a["size"]
        meta[:, KC] = [signed32(crc32_length_constant(p.size - 4)) for p in plans]
        _TABLES[key] = (b, *(torch.from_numpy(t).to(device) for t in
                             (meta.reshape(-1), np.concatenate([p.template for p in plans]), a["starts"])))
    return _TABLES[key][1:]  # type: ignore[return-value]


_MASK = (1 << 64) - 1
_I1, _I2 = pow(0xBF58476D1CE4E5B9, -1, 1 << 64), pow(0x94D049BB133111EB, -1, 1 << 64)  # mix64's multipliers
_KEYS: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}


def unmix64(z: int) -> int:
    """The inverse of :func:`dqsgd.kernels.hashrng.mix64` (each of its steps is a bijection of 64-bit words)."""
    z ^= (z >> 31) ^ (z >> 62)
    z = (z * _I2) & _MASK
    z ^= (z >> 27) ^ (z >> 54)
    z = (z * _I1) & _MASK
    return z ^ (z >> 30) ^ (z >> 60)


def split_keys(keys: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """(base, rest) with key_p = mix64(base ⊕ rest_p): base = mix64⁻¹(key_0), rest_p = mix64⁻¹(key_p) ⊕ base.
    A HashRNG key is mix64(A ⊕ C) with A from (seed, step) and C from the worker alone, so the keys of
    one rank's shards (one seed and step) have the same ``rest`` at every step: ``rest`` is copied to
    the device once and ``base`` is written into a 1-element device tensor the kernel reads
    (``workspace.step_key``), with no host-to-device copy per call."""
    raw = [unmix64(k & _MASK) for k in keys]
    return raw[0], tuple(r ^ raw[0] for r in raw)


def _keys_on(rest: tuple[int, ...], device: torch.device) -> torch.Tensor:
    key = (rest, str(device))
    if key not in _KEYS:
        if len(_KEYS) > 256:
            _KEYS.clear()
        _KEYS[key] = torch.tensor([signed64(r) for r in rest], dtype=torch.int64).to(device)
    return _KEYS[key]


def signed32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def _mode(b: Batch) -> tuple[int, int, int]:
    """(MODE, STEPS, bucket) of the batch's layouts (``triton_codec._Segments``, shared by every payload)."""
    layouts = {lay for _, lay in b.spec}
    if len({lay.sizes is None for lay in layouts}) != 1 or len({lay.bucket for lay in layouts}) != 1:
        raise ValueError(f"a Triton batch needs one kind of layout for every payload, got {layouts}")
    lay = next(iter(layouts))
    if lay.sizes is not None:
        return 2, max(max(int(np.diff(b.arrays["seg_at"]).max()) - 1, 1).bit_length(), 1), 1
    return (1, 1, lay.bucket) if lay.bucket > 0 else (0, 1, 1)


def _crc(b: Batch, buf: torch.Tensor, meta: torch.Tensor, stats: torch.Tensor | None = None,
         bad: torch.Tensor | None = None, copy: torch.Tensor | None = None,
         level0: tuple[torch.Tensor, int] | None = None, gap: int = 0) -> None:
    """Every payload's crc written into ``buf`` (or, with ``stats``, checked: see ``_crc_batch``);
    ``level0 = (raws, at)``: the raws of level 0 already computed by the encode (from ``raws[at]``,
    blocks per payload, payload after payload): the tree starts at level 1; ``gap``: the bytes after
    each payload that its last level zeroes (at most GAP)."""
    count_, level, src, dev, verify = int(b.arrays["size"].max()) - 4, 0, buf, buf.device, stats is not None
    src_at = 0
    if level0 is not None:
        count_, level, (src, src_at) = level0_blocks(count_)[0], 1, level0
    while True:
        programs = max(-(-count_ // (FAN * ROWS)), 1)
        raws = scratch(("crc", verify, level), len(b.plans) * programs, torch.int32, dev)
        tab, comb = tables_on(dev, level)
        _crc_batch[(programs, len(b.plans))](src, src_at, tab, comb, raws, buf, raws if stats is None else stats,
                                             raws if bad is None else bad, raws if copy is None else copy, meta,
                                             count_, programs, gap, ROWS=ROWS, LEVEL0=level == 0, FINAL=programs == 1,
                                             VERIFY=verify, NSTATS=STATS, GAP=GAP)
        if programs == 1:
            return
        src, src_at, count_, level = raws, 0, programs, level + 1


def encode_batch_triton(b: Batch, flat: torch.Tensor, keys: Sequence[int], key: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """:meth:`Batch.encode` on ``flat``'s device: the norm, the headers and bodies, and the crc's
    level(s), each one launch for every shard (max norm; an l2 norm is the host's expression per
    shard). The kernel reads the keys' per-step part (``split_keys(keys)[0]``) from ``key``, a
    1-element int64 device tensor the caller keeps (``workspace.write_key``; a CUDA graph captured
    around the call replays at the step whose base it holds), or, None, from the workspace's buffer
    into which this call writes it (:func:`dqsgd.kernels.workspace.step_key`)."""
    from dqsgd.kernels.device import device_scales

    dev, plans, levels = flat.device, b.plans, b.plans[0].levels
    meta, heads, starts = _tables(b, dev)
    mode, steps, bucket = _mode(b)
    x = flat.detach().reshape(-1).contiguous()
    nseg = int(b.arrays["seg_at"][-1])
    blocks = level0_blocks(int(b.arrays["size"].max()) - 4)[0]
    if b.norm == Norm.MAX:  # one zero fill for the norms' atomics and the crc's level-0 raws
        bits = scratch("absmax", nseg + len(plans) * blocks, torch.int32, dev, zero=True)
        _absmax_batch[(triton.cdiv(int(b.arrays["numels"].max()), BLOCK), len(plans))](
            x, bits, starts, meta, bucket, BLOCK=BLOCK, MODE=mode, STEPS=steps)
        scales, raws, raw_at = bits.view(torch.float32), bits, nseg  # the kernels read scales[:nseg] only
    else:
        scales = torch.cat([device_scales(x[o : o + p.numel], b.norm, p.layout, p.starts.size - 1, False)
                            for p, o in zip(plans, b.out_at)])
        raws, raw_at = scratch("crc0", len(plans) * blocks, torch.int32, dev, zero=True), 0
    gap = b.total - b.offsets[-1] - b.sizes[-1]  # the bytes after each payload (encode_batch's gap)
    # every byte but the gaps is written by the kernels, the gaps by the crc's last level: no zero fill
    out = (torch.empty if gap <= GAP else torch.zeros)(b.total, dtype=torch.uint8, device=dev)
    base, rest = split_keys(keys)
    grid = max(max(triton.cdiv(triton.cdiv(p.numel, 8), GROUPS), triton.cdiv(p.head_len, HB)) for p in plans)
    rec = torch.reciprocal(scales, out=scratch("rec", scales.numel(), torch.float32, dev))
    _encode_batch[(grid, len(plans))](x, scales, rec, starts, out, heads, _keys_on(rest, dev), meta,
                                      block_table_on(dev), raws, raw_at, bucket, step_key("batch", base, dev, key),
                                      blocks, BITS=b.bits,
                                      LEVELS=levels, WB=pow2(b.bits), GROUPS=GROUPS, MODE=mode, STEPS=steps, HB=HB,
                                      BLOG=body_log(b.bits))
    _crc(b, out, meta, level0=(raws, raw_at), gap=gap if gap <= GAP else 0)
    return out


def accumulate_batch_triton(b: Batch, buf: torch.Tensor, out: torch.Tensor, weight: float, bad: torch.Tensor,
                            fresh: bool = False) -> None:
    """:meth:`Batch.accumulate` on ``buf``'s device, checks deferred into ``bad``: the crc check
    (one launch per level, which also copies the scales), ``r/levels``, and one decode launch, which
    sums the payloads of each place in registers and writes it once. ``fresh``: ``out``'s slices are
    not read (their sums are written as if they held zeros, bit for bit), one read of 4 bytes per
    coordinate less, for a caller whose ``out`` starts at zero."""
    from dqsgd.kernels.device_decode import step_divisor

    dev, plans = buf.device, b.plans
    need = max(o + p.numel for o, p in zip(b.out_at, plans))
    if out.dtype != torch.float32 or not out.is_contiguous() or out.device != dev or out.numel() < need:
        raise ValueError(f"out must be a contiguous float32 tensor of {need} elements on {dev}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if buf.dtype != torch.uint8 or buf.numel() < b.total:
        raise ValueError(f"buf must be a uint8 tensor of at least {b.total} bytes, got {buf.dtype} {tuple(buf.shape)}")
    out_at = set(b.out_at)
    per = len(plans) if len(out_at) == 1 else 1
    if per == 1 and len(out_at) != len(plans):
        raise ValueError("a Triton batch adds its payloads all at one place or each at its own")
    meta, heads, starts = _tables(b, dev)
    mode, steps_, bucket = _mode(b)
    nseg = int(b.arrays["seg_at"][-1])
    stats = scratch("stats", len(plans) * STATS, torch.int32, dev)
    scales = scratch("scales", nseg, torch.float32, dev)
    _crc(b, buf.reshape(-1), meta, stats, bad, scales.view(torch.uint8))
    step = torch.div(scales, step_divisor(dev, plans[0].levels), out=scratch("step", nseg, torch.float32, dev))
    rng = wire.code_range(Scheme.UNIFORM, b.bits, plans[0].levels)
    grid = max(max(triton.cdiv(triton.cdiv(p.numel, 8), GROUPS), triton.cdiv(p.head_len, HB), 1) for p in plans)
    _decode_batch[(grid, len(plans) // per)](buf, step, starts, out.reshape(-1), stats, bad, heads, meta,
                                             float(np.float32(weight)), bucket, rng.lo, rng.hi, int(rng.zero_ok),
                                             R=per, BITS=b.bits, WB=pow2(b.bits), GROUPS=GROUPS, MODE=mode,
                                             STEPS=steps_, HB=HB, NSTATS=STATS, FRESH=fresh,
                                             enable_fp_fusion=False)
