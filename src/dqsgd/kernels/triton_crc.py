"""zlib's CRC-32 of a ``uint8`` tensor in Triton kernels: a 2048-ary tree of table lookups.

The algebra is :mod:`dqsgd.kernels.device_crc`'s: ``raw(D)`` (the register after feeding D into a
register that starts at 0) is linear over GF(2), leading zero bytes leave it unchanged, and
``zlib.crc32(D) = raw(D) ⊕ zlib.crc32(0^|D|)``. Here each program reduces 2048 elements (ROWS = 8
groups of 256) to one raw, so a stream of up to 2 KiB takes one kernel launch, 4 MiB two, 8 GiB three:

* level 0: the stream is padded *in front* with zero bytes to whole blocks of 2048 bytes (free:
  the padding is leading zeros). Byte b at position q of a 256-byte group contributes ``T0[q][b]``
  = raw of the 256-byte group that is zero but for b at q; ``raw(group) = ⊕_q T0[q][group[q]]``
  (linearity), one table lookup per byte and an XOR reduction (XOR is associative and commutative,
  so the reduction order of the compiler cannot change the result).
* level ℓ ≥ 1: the raws of the previous level, each standing for S = 2048^ℓ bytes, again padded in
  front (with zero raws: zero blocks, leading zeros) to blocks of 2048. Raw r at position q of a
  group contributes ``M_{(255−q)·S}·r`` (the shift across the bytes of the raws after it), applied
  as four lookups in 256-entry tables (``M`` is linear: ``M·r = ⊕_j M·(byte_j(r) << 8j)``).
* every level: the program's 8 group raws are combined into one, group g's shifted across the
  groups after it (``M_{(7−g)·256·S}``, four lookups each).
* the last level has one program; it adds the length constant and writes the four crc bytes (or,
  for a decoder, compares them with the stored ones and sets its flags).

All lookups are exact integer operations: the crc is zlib's bit for bit on every backend. The
tables (level 0: 256×256, each further level 256×4×256 int32, and 8×4×256 per level to combine)
are computed on the host from zlib's polynomial arithmetic once and copied to each device once.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np
import torch
import triton
import triton.language as tl

from dqsgd.codecs.threads import multmodp
from dqsgd.kernels.device_crc import byte_tables, crc32_length_constant, x8n
from dqsgd.kernels.workspace import scratch

__all__ = ["crc32_triton"]

FAN = 256  # elements per group
ROWS = 8  # groups per program (combined into one raw)
BLOCK0 = FAN * ROWS  # bytes per level-0 block


@triton.jit
def _xor_rows(c, ROWS: tl.constexpr):
    """⊕ along axis 1 of a (ROWS, 256) tensor as a tree of halvings (reshape + split): exact in any
    order, and unlike ``tl.xor_sum`` fast in the CPU interpreter too."""
    for s in tl.static_range(8):
        a, b = tl.split(tl.reshape(c, (ROWS, 128 >> s, 2)))
        c = a ^ b
    return tl.reshape(c, (ROWS,))


@triton.jit
def _shift(tab_ptr, v):
    """M·v for int32 raws v, M given by its four 256-entry tables at tab_ptr (one lookup per byte)."""
    c = tl.load(tab_ptr + (v & 0xFF))
    c ^= tl.load(tab_ptr + 256 + ((v >> 8) & 0xFF))
    c ^= tl.load(tab_ptr + 512 + ((v >> 16) & 0xFF))
    return c ^ tl.load(tab_ptr + 768 + ((v >> 24) & 0xFF))


@triton.jit(do_not_specialize=["copy_at", "copy_len", "src_at"])
def _crc_level(src_ptr, src_at, tab_ptr, comb_ptr, raw_ptr, dst_ptr, stats_ptr, bad_ptr, copy_ptr, copy_at, copy_len, n, pad,
               k_const, ROWS: tl.constexpr, LOOKUPS: tl.constexpr, FINAL: tl.constexpr, VERIFY: tl.constexpr,
               COPY: tl.constexpr):
    """raw_ptr[program] = raw of this program's ROWS groups of 256 elements: each group's raw is
    ⊕_q (contribution of its element q), and group r's is shifted across the groups after it
    (``comb``: the tables of M_{(ROWS−1−r)·256·S}); elements are bytes (LOOKUPS = 1) or raws
    (LOOKUPS = 4). FINAL (one program): raw_ptr[0] = the crc
    ``raw ⊕ k_const``, and either write it as 4 little-endian bytes at dst_ptr (VERIFY 0) or compare
    it with the 4 bytes there and start the decode kernel's stats (``triton_codec.STATS``) with
    stats[2] = mismatch (VERIFY ≥ 1); VERIFY 2 also sets ``*bad`` on a mismatch (never clears it).
    COPY (level 0): bytes [copy_at, copy_at + copy_len) of the stream are also copied to copy_ptr."""
    g = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    q = tl.arange(0, 256)
    i = g[:, None] * 256 + q[None, :] - pad
    ok = (i >= 0) & (i < n)
    v = tl.load(src_ptr + src_at + i, mask=ok, other=0).to(tl.int32)
    if COPY:
        tl.store(copy_ptr + (i - copy_at), v.to(tl.uint8), mask=ok & (i >= copy_at) & (i < copy_at + copy_len))
    raw = crc_raw(v, q, tab_ptr, comb_ptr, ROWS, LOOKUPS)
    if FINAL:
        raw = raw ^ k_const
        crc_verdict(raw, dst_ptr, stats_ptr, bad_ptr, VERIFY)
    tl.store(raw_ptr + tl.program_id(0), raw)


@triton.jit
def crc_raw(v, q, tab_ptr, comb_ptr, ROWS: tl.constexpr, LOOKUPS: tl.constexpr):
    """The raw of a program's (ROWS, 256) elements ``v`` (bytes: LOOKUPS 1, raws: 4) at positions q."""
    if LOOKUPS == 1:
        c = tl.load(tab_ptr + q[None, :] * 256 + (v & 0xFF))
    else:
        c = _shift(tab_ptr + q[None, :] * 1024, v)
    rows = _shift(comb_ptr + tl.arange(0, ROWS) * 1024, _xor_rows(c, ROWS))
    return tl.xor_sum(rows, axis=0)


@triton.jit
def _xor_all(c, SIZE: tl.constexpr, LOG: tl.constexpr):
    """⊕ of all SIZE = 2^LOG elements of ``c`` (any shape) as a tree of halvings: exact in any order."""
    c = tl.reshape(c, (SIZE,))
    for s in tl.static_range(LOG - 1):
        a, b = tl.split(tl.reshape(c, (SIZE >> (s + 1), 2)))
        c = a ^ b
    return tl.xor_sum(c, axis=0)


@triton.jit
def crc_scatter(v, s, ok, tab_ptr, raw_ptr, pad, SIZE: tl.constexpr, LOG: tl.constexpr):
    """Level 0 of the tree for bytes a kernel has just written (the crc fused into the encode): XOR
    into ``raw_ptr[block]`` the contributions of bytes ``v`` (int32 0..255, SIZE = 2^LOG of them,
    ``ok`` the valid ones) at stream positions ``s``. The stream is padded in front by ``pad`` zero
    bytes to whole blocks of BLOCK0 bytes, as ``_crc_level``'s level 0 pads it; the byte at offset
    o of its block contributes ``TB[o][v]`` (:func:`block_table`), so the raws come out those level
    0 computes. The valid bytes must span at most BLOCK0 bytes (two blocks): one atomic XOR into
    each (XOR is associative and commutative: the order of the programs cannot matter)."""
    t = s + pad
    blk = tl.where(ok, t // 2048, 0x7FFFFFFFFFFF)
    c = tl.load(tab_ptr + (t % 2048) * 256 + v, mask=ok, other=0)
    first = tl.min(tl.reshape(blk, (SIZE,)), axis=0)
    lo = _xor_all(tl.where(blk == first, c, 0), SIZE, LOG)
    hi = _xor_all(tl.where(ok & (blk != first), c, 0), SIZE, LOG)
    tl.atomic_xor(raw_ptr + first, lo, mask=lo != 0)
    tl.atomic_xor(raw_ptr + first + 1, hi, mask=hi != 0)


@triton.jit
def crc_verdict(crc, dst_ptr, stats_ptr, bad_ptr, VERIFY: tl.constexpr):
    """VERIFY 0: write ``crc`` as 4 little-endian bytes at dst_ptr; else compare it with the 4 bytes
    there and start the decode kernel's stats (stats[2] = mismatch); VERIFY 2 also sets ``*bad`` on
    a mismatch."""
    k = tl.arange(0, 4)
    if VERIFY == 0:
        tl.store(dst_ptr + k, ((crc >> (8 * k)) & 0xFF).to(tl.uint8))
    else:
        wrong = crc != tl.sum(tl.load(dst_ptr + k).to(tl.int32) << (8 * k), axis=0)
        j = tl.arange(0, 16)  # triton_codec.STATS = 9 of them
        init = tl.where(j == 4, 0x7FFFFFFF, tl.where(j == 5, -0x7FFFFFFF, 0))
        tl.store(stats_ptr + j, tl.where(j == 2, wrong.to(tl.int32), init), mask=j < 9)
        if VERIFY == 2:
            tl.store(bad_ptr, wrong, mask=wrong)


def _int32(tab: np.ndarray) -> np.ndarray:
    return (tab.astype(np.int64) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


def _apply_np(tabs: np.ndarray, c: np.ndarray) -> np.ndarray:
    out = tabs[0][c & 0xFF]
    for j in range(1, 4):
        out = out ^ tabs[j][(c >> (8 * j)) & 0xFF]
    return out


def _shift_table(nbytes: int) -> np.ndarray:
    """(4, 256) int64: the lookup tables of M_nbytes (the shift across nbytes zero bytes)."""
    return byte_tables(np.array([multmodp(x8n(nbytes), 1 << i) for i in range(32)], dtype=np.int64))


@lru_cache(maxsize=None)
def _combine_table(level: int) -> np.ndarray:
    """(ROWS, 4, 256): the tables of M_{(ROWS−1−r)·256·S}, S = (256·ROWS)^ℓ bytes per element."""
    size = (FAN * ROWS) ** level
    return _int32(np.stack([_shift_table((ROWS - 1 - r) * FAN * size) for r in range(ROWS)]))


@lru_cache(maxsize=None)
def _level_table(level: int) -> np.ndarray:
    """Level 0: (256, 256), T0[q][b]; level ℓ ≥ 1: (256, 4, 256), the tables of M_{(255−q)·S},
    S = (256·ROWS)^ℓ bytes per element (a raw of the level below).

    Built backwards from q = 255 (no shift): the entries at q are M_S applied to those at q + 1
    (S = 1 byte at level 0), four vectorized lookups per step."""
    size = (FAN * ROWS) ** level
    step = _shift_table(size)
    if level == 0:
        zero = zlib.crc32(b"\0")
        cur = np.array([zlib.crc32(bytes([b])) ^ zero for b in range(256)], dtype=np.int64)
    else:
        cur = (np.arange(256, dtype=np.int64)[None, :] << (8 * np.arange(4, dtype=np.int64))[:, None])
    rows = [cur]
    for _ in range(FAN - 1):
        cur = _apply_np(step, cur)
        rows.append(cur)
    return _int32(np.stack(rows[::-1]))


@lru_cache(maxsize=None)
def block_table() -> np.ndarray:
    """(BLOCK0, 256): ``TB[o][b]`` = raw of a BLOCK0-byte block that is zero but for byte b at offset
    o: ``T0[o % 256][b]`` shifted across the groups after its own (level 0's combine tables), so
    ``raw(block) = ⊕_o TB[o][block[o]]``, which is what ``_crc_level`` computes at level 0."""
    t0, comb = _level_table(0).astype(np.int64) & 0xFFFFFFFF, _combine_table(0).astype(np.int64) & 0xFFFFFFFF
    return _int32(np.concatenate([_apply_np(comb[r], t0) for r in range(ROWS)]))


_DEVICE_TABLES: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
_BLOCK_TABLES: dict[str, torch.Tensor] = {}


def block_table_on(device: torch.device) -> torch.Tensor:
    """:func:`block_table` on ``device`` (flat int32), copied once."""
    if str(device) not in _BLOCK_TABLES:
        _BLOCK_TABLES[str(device)] = torch.from_numpy(block_table().reshape(-1).copy()).to(device)
    return _BLOCK_TABLES[str(device)]


def level0_blocks(nbytes: int) -> tuple[int, int]:
    """(blocks, front padding) of level 0 for a stream of ``nbytes`` (one block at least)."""
    blocks = max(-(-nbytes // BLOCK0), 1)
    return blocks, blocks * BLOCK0 - nbytes


def tables_on(device: torch.device, level: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(element tables, combine tables) of a level on ``device``, copied once."""
    key = (str(device), level)
    if key not in _DEVICE_TABLES:
        _DEVICE_TABLES[key] = tuple(torch.from_numpy(t.reshape(-1).copy()).to(device)
                                    for t in (_level_table(level), _combine_table(level)))
    return _DEVICE_TABLES[key]


def crc32_triton(data: torch.Tensor, dst: torch.Tensor | None = None, stats: torch.Tensor | None = None,
                 bad: torch.Tensor | None = None, copy: tuple[torch.Tensor, int] | None = None,
                 level0: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """``zlib.crc32(data)`` of a 1-D contiguous uint8 tensor as a 0-dim int32 tensor holding its bits
    (``& 0xFFFFFFFF`` of its int64 value), on ``data.device``, with no host sync. ``dst`` (4 uint8
    on the same device), if given, receives it as 4 little-endian bytes; with ``stats`` (int32, the
    decode kernel's ``triton_codec.STATS`` of them) it is compared with the bytes in ``dst`` instead,
    and stats is started: stats[2] = mismatch; ``bad`` (a 0-dim bool), if given, is set on a mismatch.
    ``copy = (to, at)``: bytes [at, at + len(to)) of ``data`` are also copied into ``to`` (uint8) on
    the way (the decoder's aligned copy of the stored scales). ``level0 = (raws, at)``: the raws of
    level 0 (``level0_blocks(len(data))[0]`` of them, from ``raws[at]`` on) already computed where the
    bytes were written (:func:`crc_scatter`): the tree starts at level 1 and ``data`` is not read. Inside ``workspace.use`` the returned
    tensor is a scratch buffer: valid until the next call in that workspace."""
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError(f"crc32 needs a contiguous 1-D uint8 tensor, got {data.dtype} {tuple(data.shape)}")
    n, dev = data.numel(), data.device
    if level0 is not None and copy is not None:
        raise ValueError("copy needs level 0 of the tree, which level0= skips")
    dst = torch.empty(4, dtype=torch.uint8, device=dev) if dst is None else dst
    k_const = crc32_length_constant(n)
    k_signed = k_const - (1 << 32) if k_const >= 1 << 31 else k_const
    verify = 0 if stats is None else 1 if bad is None else 2
    src, src_at, count, level = (data, 0, n, 0) if level0 is None else (*level0, level0_blocks(n)[0], 1)
    while True:
        programs = max(-(-count // (FAN * ROWS)), 1)  # n = 0: one program of zero bytes (raw 0)
        raws = scratch(("crc1", verify, level), programs, torch.int32, dev)
        final = programs == 1
        tab, comb = tables_on(dev, level)
        to, at = copy if copy is not None and level == 0 else (raws, 0)
        _crc_level[(programs,)](src, src_at, tab, comb, raws, dst, raws if stats is None else stats,
                                raws if bad is None else bad, to, at, to.numel() if to is not raws else 0, count,
                                programs * FAN * ROWS - count, k_signed, ROWS=ROWS, LOOKUPS=1 if level == 0 else 4,
                                FINAL=final, VERIFY=verify, COPY=to is not raws)
        if final:
            return raws.reshape(())
        src, src_at, count, level = raws, 0, programs, level + 1
