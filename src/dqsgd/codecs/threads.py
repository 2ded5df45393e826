"""Running the codec's big loops on several threads: contiguous ranges, one per thread.

The fused kernels (:mod:`dqsgd.kernels.fused`) and ``zlib.crc32`` release the GIL, so a plain
thread pool runs them in parallel. Work is split into contiguous ranges of equal size, the
calling thread taking the first; results come back in range order. Everything split this way
gives the same bits at every thread count: each range writes only its own outputs, and the
crc of a split buffer is recombined exactly (:func:`crc32_combine`).

The thread count is ``torch.get_num_threads()`` (what ``train.threads`` and ``--threads`` set),
and a range is never smaller than ``min_per_thread`` units, so small tensors stay on one thread.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

__all__ = ["crc32", "crc32_combine", "run_split", "split", "thread_count"]

_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_size = 0
CRC_MIN_BYTES = 1 << 20  # below this a crc stays on one thread (≈ 0.3 ms)


def thread_count() -> int:
    """Threads the codec may use: torch's intra-op thread count."""
    return max(1, torch.get_num_threads())


def split(total: int, parts: int, min_per_part: int = 1) -> list[tuple[int, int]]:
    """``[0, total)`` as at most ``parts`` contiguous ranges of ≥ ``min_per_part`` (but ≥ 1 range)."""
    k = max(1, min(parts, total // max(1, min_per_part)))
    bounds = [total * i // k for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k)]


def _executor(workers: int) -> ThreadPoolExecutor:
    """The process's pool, rebuilt after a fork (a forked child has none of its threads)."""
    global _pool, _pool_pid, _pool_size
    if _pool is None or _pool_pid != os.getpid() or _pool_size < workers:
        if _pool is not None and _pool_pid == os.getpid():
            _pool.shutdown(wait=False)  # a bigger one replaces it
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dqsgd-codec")
        _pool_pid, _pool_size = os.getpid(), workers
    return _pool


def run_split(fn: Callable[..., Any], total: int, *args: Any, min_per_thread: int = 1,
              threads: int | None = None) -> list[Any]:
    """``[fn(*args, lo, hi) for (lo, hi) in split(total, threads)]``, the ranges run in parallel."""
    ranges = split(total, thread_count() if threads is None else threads, min_per_thread)
    if len(ranges) == 1:
        return [fn(*args, *ranges[0])]
    pool = _executor(len(ranges) - 1)
    futures = [pool.submit(fn, *args, lo, hi) for lo, hi in ranges[1:]]
    first = fn(*args, *ranges[0])
    return [first] + [f.result() for f in futures]


# ------------------------------------------------------------------------------------------ crc

_POLY = 0xEDB88320  # CRC-32 (ISO-HDLC, zlib's), bit-reflected


def multmodp(a: int, b: int) -> int:
    """a(x)·b(x) mod p(x) for reflected 32-bit polynomials (zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    """x^(2^k) mod p(x), k = 0..31."""
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = multmodp(p, p)
    return table


X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(A ∥ B) from crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B) (zlib 1.2.12's method:
    crc1 times x^(8·len2) mod p, plus crc2)."""
    p, k, n = 1 << 31, 3, len2  # x^0; multiply by x^(n·2^3) = x^(8·len2)
    while n:
        if n & 1:
            p = multmodp(X2N[k & 31], p)
        n >>= 1
        k += 1
    return multmodp(p, crc1) ^ crc2


def crc32(data: Any, value: int = 0, *, threads: int | None = None) -> int:
    """``zlib.crc32(data, value)``, computed on several threads for big buffers (same result)."""
    buf = memoryview(data).cast("B")
    ranges = split(len(buf), thread_count() if threads is None else threads, CRC_MIN_BYTES)
    if len(ranges) == 1:
        return zlib.crc32(buf, value)
    parts = run_split(lambda lo, hi: zlib.crc32(buf[lo:hi]), len(buf), min_per_thread=CRC_MIN_BYTES,
                      threads=len(ranges))
    crc = zlib.crc32(b"", value)
    for (lo, hi), c in zip(ranges, parts):
        crc = crc32_combine(crc, c, hi - lo)
    return crc
