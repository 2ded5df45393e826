"""zlib's CRC-32 of a ``uint8`` tensor, computed with torch ops on the tensor's device.

CRC-32 is affine over GF(2). Write ``raw(D)`` for the CRC register after feeding the bytes D into
a register that starts at 0 (no initial value, no final xor). Then

* ``raw`` is linear in D, and leading zero bytes do not change it (0 stays 0);
* ``raw(A ‖ B) = M_|B| · raw(A) ⊕ raw(B)``, where ``M_L`` (a 32×32 matrix over GF(2)) is
  multiplication by x^(8L) mod p(x): the shift of a register across L zero bytes;
* ``zlib.crc32(D) = raw(D) ⊕ K(|D|)`` with ``K(L) = zlib.crc32(0^L)`` = ``M_L·0xFFFFFFFF ⊕ 0xFFFFFFFF``.

So the device computes ``raw`` as a reduction tree, and the host adds the length constant:

1. Pad D in front with zero bytes to a multiple of 4 (free, by the second bullet), and read it as
   32-bit words. ``raw`` of one word is the XOR of four 256-entry table lookups, one per byte
   position (tables ``T_k[b] = raw`` of a word holding b at position k).
2. Level by level, combine neighbouring blocks: all blocks of a level have the same length L
   (4·2^level bytes), so the left block is shifted by the ONE matrix ``M_L``, applied as four
   lookups in 256-entry tables (``M_L`` is linear: ``M_L·c = ⊕_j M_L·(byte_j(c) << 8j)``). An
   odd count gets a zero block in front (a zero block is leading zeros: it changes nothing).

The tables are computed on the host once per level from zlib's own polynomial arithmetic
(``dqsgd.codecs.threads``), cached, and copied to each device once. Work: about 2× the word count
of table lookups; log2(words) levels, each a few elementwise ops. Integers are int64 (the device
form of uint32: XOR, shifts and gathers of values < 2^32 are exact in int64).
"""

from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np
import torch

from dqsgd.codecs.threads import X2N, multmodp

__all__ = ["crc32_device", "crc32_length_constant", "crc32_with", "crc_tables"]

_ALL_ONES = 0xFFFFFFFF


def x8n(nbytes: int) -> int:
    """x^(8·nbytes) mod p(x) (zlib's ``x2nmodp(nbytes, 3)``)."""
    p, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            p = multmodp(X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def byte_tables(images: np.ndarray) -> np.ndarray:
    """(4, 256) int64: ``tab[j][b]`` = ⊕ of ``images[8j + i]`` over the set bits i of b, for a linear
    map given by its images of the 32 basis vectors (bit i of the input)."""
    b = np.arange(256, dtype=np.int64)
    tab = np.zeros((4, 256), dtype=np.int64)
    for j in range(4):
        for i in range(8):
            tab[j] ^= np.where((b >> i) & 1, images[8 * j + i], 0)
    return tab


@lru_cache(maxsize=None)
def _shift_tables(level: int) -> np.ndarray:
    """The four lookup tables of M_L, L = 4·2^level bytes."""
    xl = x8n(4 << level)
    return byte_tables(np.array([multmodp(xl, 1 << i) for i in range(32)], dtype=np.int64))


@lru_cache(maxsize=None)
def _word_tables() -> np.ndarray:
    """``T_k[b]`` = raw of the 4-byte word with byte b at position k (zeros elsewhere)."""
    zero = zlib.crc32(bytes(4))
    tab = np.zeros((4, 256), dtype=np.int64)
    for k in range(4):
        for b in range(256):
            word = bytearray(4)
            word[k] = b
            tab[k, b] = zlib.crc32(word) ^ zero  # raw(D) = crc32(D) ⊕ crc32(0^|D|)
    return tab


_DEVICE_TABLES: dict[tuple[str, int], torch.Tensor] = {}


def _tables(device: torch.device, levels: int) -> torch.Tensor:
    """(levels + 1, 4, 256) int64 on ``device``: word tables, then the shift tables of each level."""
    key = (str(device), levels)
    if key not in _DEVICE_TABLES:
        host = np.stack([_word_tables()] + [_shift_tables(k) for k in range(levels)])
        _DEVICE_TABLES[key] = torch.from_numpy(host).to(device)
    return _DEVICE_TABLES[key]


def _apply(tab: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """⊕_j tab[j][byte j of c] for int64 values c < 2^32."""
    out = tab[0][c & 0xFF]
    for j in range(1, 4):
        out = out ^ tab[j][(c >> (8 * j)) & 0xFF]
    return out


def _levels(words: int) -> int:
    return max(words - 1, 0).bit_length()


def crc_tables(device: torch.device, nbytes: int) -> torch.Tensor:
    """The lookup tables :func:`crc32_with` needs for ``nbytes`` bytes, on ``device`` (cached)."""
    return _tables(device, _levels(-(-nbytes // 4)))


def crc32_with(data: torch.Tensor, tabs: torch.Tensor, constant: int) -> torch.Tensor:
    """``raw(data) ⊕ constant`` of a 1-D uint8 tensor with the tables of :func:`crc_tables` (pure
    tensor ops: what a compiled caller traces; ``constant = crc32_length_constant(n)`` gives zlib's crc)."""
    n = data.numel()
    if n == 0:
        return torch.full((), constant, dtype=torch.int64, device=data.device)
    words = -(-n // 4)
    padded = torch.nn.functional.pad(data, (4 * words - n, 0)).view(words, 4).to(torch.int64)
    c = tabs[0][0][padded[:, 0]]
    for k in range(1, 4):
        c = c ^ tabs[0][k][padded[:, k]]
    for level in range(_levels(words)):
        if c.numel() % 2:
            c = torch.nn.functional.pad(c, (1, 0))
        pairs = c.view(-1, 2)
        c = _apply(tabs[level + 1], pairs[:, 0]) ^ pairs[:, 1]
    return c.reshape(()) ^ constant


@lru_cache(maxsize=1024)
def crc32_length_constant(nbytes: int) -> int:
    """``K(n) = zlib.crc32(bytes(n))`` in O(log n) host time."""
    return multmodp(x8n(nbytes), _ALL_ONES) ^ _ALL_ONES


def crc32_device(data: torch.Tensor) -> torch.Tensor:
    """``zlib.crc32(data)`` of a 1-D uint8 tensor: a 0-dim int64 tensor on ``data.device`` (no sync)."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"crc32 needs a 1-D uint8 tensor, got {data.dtype} {tuple(data.shape)}")
    n = data.numel()
    return crc32_with(data, crc_tables(data.device, n), crc32_length_constant(n))
