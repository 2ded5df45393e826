"""A counter-based hash RNG: uniform u_i = hash(seed, step, worker, i), the same on every path.

Stochastic rounding needs one uniform per coordinate, and ``torch.rand`` is single-threaded
(≈ 0.19 G/s, docs/design.md), so the fused kernels draw their uniforms from a *counter-based*
generator instead: a pure function of a 64-bit key and the coordinate index, which a compiled
loop can evaluate anywhere in any order (chunked, in parallel) and which torch integer ops on any
device reproduce bit for bit.

Definition (SplitMix64, Steele, Lea & Flood 2014; the finalizer is Stafford's "Mix13")::

    mix64(z)  = z ← (z ⊕ z≫30)·0xBF58476D1CE4E5B9;  z ← (z ⊕ z≫27)·0x94D049BB133111EB;  z ⊕ z≫31
    key       = mix64(mix64(mix64(seed + γ) ⊕ mix64(step + 2γ)) ⊕ mix64(worker + 3γ))
    h_j       = mix64(key + (j + 1)·γ)                  (γ = 0x9E3779B97F4A7C15, all mod 2^64)
    u_{4j+k}  = (((h_j ≫ 16k) mod 2^16) + 1/2) · 2^-16    k = 0, 1, 2, 3

So ``h_j`` is output j of the SplitMix64 stream seeded with ``key``, and each output gives four
coordinates their 16-bit uniforms (one 64-bit hash per four coordinates: a quarter of the
multiplications of one hash per coordinate; on AVX2, which has no 64-bit vector multiply, the
hash is what costs). The u_i are the 2^16 midpoints (m + 1/2)·2^-16, exact in float32, all in
(0, 1). Two keys give overlapping streams only if they differ by a multiple m·γ with |m| < n/4,
which for keys spread by mix64 has probability ≈ n/2^66.

Resolution and bias. Stochastic rounding compares u with the fractional part f ∈ [0, 1) of the
scaled coordinate: P(u < f) = ⌈2^16·f − 1/2⌉ / 2^16 (the number of midpoints below f), which is
within 2^-17 of f, and equals f exactly when 2^16·f is an integer (f = 0: a coordinate on a
level is never moved). So with 16-bit uniforms the quantizer of :mod:`dqsgd.quantizers.uniform`
has, per coordinate, |E[Q(v)_i] − v_i| ≤ 2^-17 · r/s (r the segment's norm, s its levels): a
bias of at most 1/131072 of one quantization step, while the rounding noise has standard
deviation up to 1/2 step. The 1-bit quantizer (P(c = +1) = (1 + v/r)/2) has |E[r·c] − v| ≤
2^-16 · r. ``tests/kernels/test_kernels_unbiased.py`` checks both bounds exactly, by
enumerating all 2^16 values of u.

The torch version works in int64 (two's complement: the same bits as uint64) and relies on
wrap-around integer multiplication and addition, which CPU and CUDA integer units do; logical
right shifts are ``(z >> k) & (2^(64-k) - 1)``. The test suite checks it against the compiled
version bit for bit on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from numba import njit

__all__ = ["HashRNG", "hash_uniform_numpy", "hash_uniform_torch", "mix64"]

GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
UNIFORM_BITS = 16  # bits per uniform; 64 / 16 = 4 coordinates per hash
INV16 = 1.0 / (1 << UNIFORM_BITS)


def mix64(z: int) -> int:
    """The SplitMix64 finalizer on a Python int (taken mod 2^64)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def signed64(v: int) -> int:
    """The int64 with the same bits as the uint64 ``v``."""
    return v - (1 << 64) if v >= 1 << 63 else v


@dataclass(frozen=True)
class HashRNG:
    """The uniforms of one (seed, step, worker): ``uniform(n)[i] = u_i`` (module docstring).

    Pass it where a quantizer takes ``rng=``; it is stateless, so the same object gives the same
    numbers every time (a new step needs a new ``HashRNG``). Shared across ranks only if they
    build it from the same triple: the trainer uses (seed_for(seed, QUANT), step, worker).
    """

    seed: int
    step: int
    worker: int

    def __post_init__(self) -> None:
        for name in ("seed", "step", "worker"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"HashRNG {name} must be an int >= 0, got {v!r}")

    @cached_property
    def key(self) -> int:
        """The 64-bit stream key (an unsigned Python int)."""
        k = mix64(int(self.seed) + GAMMA)
        k = mix64(k ^ mix64(int(self.step) + 2 * GAMMA))
        return mix64(k ^ mix64(int(self.worker) + 3 * GAMMA))

    def uniform(self, n: int, device: torch.device | str | None = None) -> torch.Tensor:
        """u_0 … u_{n-1} as float32 on ``device``, computed with torch integer ops."""
        if n < 0:
            raise ValueError(f"need n >= 0, got {n}")
        key = torch.full((), signed64(self.key), dtype=torch.int64, device=device)
        return hash_uniform_torch(key, n)

    def uniform_numpy(self, n: int) -> np.ndarray:
        """The same numbers from the compiled kernel (float32 numpy array)."""
        return hash_uniform_numpy(self.key, n)


def hash_uniform_torch(key: torch.Tensor, n: int) -> torch.Tensor:
    """u_0 … u_{n-1} of the stream whose key is the 0-dim int64 tensor ``key`` (the uint64 key's
    bits), on ``key.device``: the key is a tensor so that compiled callers do not specialise on it."""
    # Hashes for a multiple of 64 counters (sliced to n below): inductor's CPU code (torch 2.13)
    # got the vector-loop tail of this int64 arithmetic wrong; with no tail it is exact (tested).
    m = -(-((n + 3) // 4) // 64) * 64
    # `+ (key & 0)` makes j a loaded int64 value, not an index expression: inductor's CUDA code otherwise
    # folds j·γ into its int32 indexing and cannot compile (γ does not fit in int32; seen on an H200 with
    # torch 2.11). On every backend it adds 0.
    j = torch.arange(1, m + 1, dtype=torch.int64, device=key.device) + (key & 0)
    h = _mix64_torch(j * signed64(GAMMA) + key)
    # (h >> 16k) & 0xFFFF: the mask keeps bits an arithmetic shift would have filled, for every k.
    fields = torch.stack([(h >> (16 * k)) & 0xFFFF for k in range(4)], dim=1).reshape(-1)[:n]
    return (fields.to(torch.float32) + 0.5) * INV16


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` on int64 is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64_torch(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _lsr(z, 30)) * signed64(_M1)
    z = (z ^ _lsr(z, 27)) * signed64(_M2)
    return z ^ _lsr(z, 31)


# ------------------------------------------------------------------------------------ compiled

_G64 = np.uint64(GAMMA)
_K1, _K2 = np.uint64(_M1), np.uint64(_M2)
_S27, _S30, _S31 = (np.uint64(s) for s in (27, 30, 31))
_HALF = np.float32(0.5)
_INV16 = np.float32(INV16)


@njit(cache=True, inline="always")
def mix64_nb(z):  # pragma: no cover - compiled
    z = (z ^ (z >> _S30)) * _K1
    z = (z ^ (z >> _S27)) * _K2
    return z ^ (z >> _S31)


@njit(cache=True, inline="always")
def fill_hashes(key, i0, m, hbuf):  # pragma: no cover - compiled
    """hbuf[p] = h_{i0/4 + p} for p < ⌈m/4⌉ (``i0`` a multiple of 4): viewed as uint16 (the host
    is little-endian), ``hbuf.view(uint16)[t]`` is the 16-bit field of coordinate i0 + t.

    A plain store loop over the counter: LLVM vectorizes it (the 64-bit multiplies as 32-bit
    ones), 3.4x faster than converting each hash to floats in the same loop (measured)."""
    j0 = np.uint64(i0 // 4 + 1)
    hs = hbuf[: (m + 3) // 4]
    for p in range(hs.size):  # from 0: see fused._quantize_piece
        hs[p] = mix64_nb(key + (j0 + np.uint64(p)) * _G64)


@njit(cache=True, inline="always")
def to_uniform(field):  # pragma: no cover - compiled
    """The uniform of a 16-bit field: (field + 1/2)·2^-16, exact in float32."""
    return (np.float32(np.int32(field)) + _HALF) * _INV16


@njit(cache=True)
def _uniforms(key, n, out):  # pragma: no cover - compiled
    hbuf = np.empty((n + 3) // 4, np.uint64)
    fill_hashes(key, 0, n, hbuf)
    fields = hbuf.view(np.uint16)
    for i in range(n):
        out[i] = to_uniform(fields[i])


def hash_uniform_numpy(key: int, n: int) -> np.ndarray:
    """u_0 … u_{n-1} of the stream ``key`` (compiled)."""
    out = np.empty(n, dtype=np.float32)
    _uniforms(np.uint64(key & _MASK64), n, out)
    return out
