"""The codec's thread splitting: ranges cover the work exactly, and a split crc is zlib's crc."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from codec_strategies import SETTINGS
from hypothesis import given
from hypothesis import strategies as st

from dqsgd.codecs import threads
from dqsgd.codecs.threads import CRC_MIN_BYTES, crc32, crc32_combine, run_split, split


@SETTINGS
@given(a=st.binary(max_size=300), b=st.binary(max_size=300), start=st.integers(0, 2**32 - 1))
def test_crc32_combine_is_the_crc_of_the_concatenation(a: bytes, b: bytes, start: int) -> None:
    assert crc32_combine(zlib.crc32(a, start), zlib.crc32(b), len(b)) == zlib.crc32(a + b, start)


@pytest.mark.parametrize("threads_", [1, 2, 3, 7])
def test_split_crc_equals_zlib(threads_: int) -> None:
    data = np.random.default_rng(threads_).integers(0, 256, 3 * CRC_MIN_BYTES + 12345, dtype=np.uint8)
    assert crc32(data, threads=threads_) == zlib.crc32(data)
    assert crc32(memoryview(data)[7:], 0xDEADBEEF, threads=threads_) == zlib.crc32(data[7:], 0xDEADBEEF)
    assert crc32(b"", 5, threads=threads_) == 5


@SETTINGS
@given(total=st.integers(0, 10_000), parts=st.integers(1, 9), least=st.integers(1, 3000))
def test_split_covers_the_range_in_order(total: int, parts: int, least: int) -> None:
    ranges = split(total, parts, least)
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(r[1] == s[0] for r, s in zip(ranges, ranges[1:]))
    assert 1 <= len(ranges) <= parts
    assert len(ranges) == 1 or all(hi - lo >= least for lo, hi in ranges)


def test_run_split_returns_results_in_range_order_and_survives_a_fork() -> None:
    assert run_split(lambda lo, hi: (lo, hi), 10, threads=3) == [(0, 3), (3, 6), (6, 10)]
    assert run_split(lambda x, lo, hi: x * (hi - lo), 10, 2, threads=1) == [20]
    pid = os.fork()
    if pid == 0:  # the child inherits the pool object but none of its threads: it must build its own
        ok = run_split(lambda lo, hi: hi - lo, 100, threads=4) == [25, 25, 25, 25]
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert threads._pool is not None and threads._pool_pid == os.getpid()
