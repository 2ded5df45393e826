"""Fixed-width bit packing: exact bytes against an independent bit-level reference."""

from __future__ import annotations

import numpy as np
import pytest
from codec_strategies import SETTINGS
from hypothesis import given
from hypothesis import strategies as st

from dqsgd.codecs.bitpack import pack_bits, packed_size, unpack_bits


def reference_pack(u: np.ndarray, width: int) -> np.ndarray:
    """Stream bit i·w + j is bit j of value i; bytes are filled LSB first (numpy 'little')."""
    u = u.astype(np.uint64)
    bits = (u[:, None] >> np.arange(width, dtype=np.uint64)) & np.uint64(1)
    return np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little")


@SETTINGS
@given(width=st.integers(1, 32), n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_pack_matches_reference_and_round_trips(width: int, n: int, seed: int) -> None:
    u = np.random.default_rng(seed).integers(0, 1 << width, n, dtype=np.uint64)
    u[: min(n, 2)] = [(1 << width) - 1, 0][: min(n, 2)]  # the extremes
    packed = pack_bits(u, width)
    assert packed.dtype == np.uint8
    assert packed.size == (n * width + 7) // 8 == packed_size(n, width)
    assert np.array_equal(packed, reference_pack(u, width))
    assert np.array_equal(unpack_bits(packed.tobytes(), width, n).astype(np.uint64), u)


@SETTINGS
@given(width=st.integers(2, 32), n=st.integers(0, 200), seed=st.integers(0, 2**32 - 1))
def test_offset_binary_round_trip(width: int, n: int, seed: int) -> None:
    """Signed codes travel as u = c + 2^(w-1) without a temporary array."""
    half = 1 << (width - 1)
    codes = np.random.default_rng(seed).integers(-half, half, n, dtype=np.int64)
    packed = pack_bits(codes, width, offset=half)
    assert np.array_equal(packed, reference_pack(codes + half, width))
    assert np.array_equal(unpack_bits(packed, width, n, offset=half, dtype=np.int64), codes)


@pytest.mark.parametrize("dtype", [np.bool_, np.uint8, np.int8, np.uint16, np.int32, np.uint32, np.int64, np.uint64])
def test_every_integer_dtype_packs_the_same(dtype: type) -> None:
    u = np.array([1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=dtype)
    assert np.array_equal(pack_bits(u, 1), np.packbits(u.astype(np.uint8), bitorder="little"))


def test_known_bytes() -> None:
    # 4-bit values 1, 2, 3 → nibbles LSB first: 0x21, 0x03
    assert pack_bits(np.array([1, 2, 3]), 4).tobytes() == b"\x21\x03"
    # 3-bit values 7, 0, 5 → bits 111 000 101 → 0b01000111, 0b1 → 0x47, 0x01
    assert pack_bits(np.array([7, 0, 5]), 3).tobytes() == b"\x47\x01"
    assert pack_bits(np.array([0x1234]), 16).tobytes() == b"\x34\x12"
    assert pack_bits(np.array([0xDEADBEEF], dtype=np.uint64), 32).tobytes() == b"\xef\xbe\xad\xde"


def test_padding_bits_are_zero() -> None:
    for width in range(1, 33):
        packed = pack_bits(np.full(3, (1 << width) - 1, dtype=np.uint64), width)
        used = (3 * width) % 8
        if used:
            assert packed[-1] >> used == 0


@pytest.mark.parametrize("width", [0, 33, -1, 2.0, True])
def test_bad_width_is_refused(width: object) -> None:
    with pytest.raises(ValueError, match="width"):
        pack_bits(np.zeros(3, dtype=np.uint8), width)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="width"):
        unpack_bits(b"\x00" * 8, width, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize("width", [1, 3, 4, 8, 12, 16, 31, 32])
def test_values_that_do_not_fit_are_refused(width: int) -> None:
    too_big = np.zeros(20, dtype=np.int64)
    too_big[13] = 1 << width
    with pytest.raises(ValueError, match="index 13"):
        pack_bits(too_big, width)
    negative = np.zeros(20, dtype=np.int64)
    negative[5] = -1
    with pytest.raises(ValueError, match="index 5"):
        pack_bits(negative, width)
    with pytest.raises(ValueError, match="does not fit"):
        pack_bits(np.array([1 << (width - 1)]), width, offset=1 << (width - 1))


def test_non_integer_input_is_refused() -> None:
    with pytest.raises(ValueError, match="integer"):
        pack_bits(np.zeros(4, dtype=np.float32), 4)


def test_unpack_refuses_short_buffers_and_small_dtypes() -> None:
    with pytest.raises(ValueError, match="need 2"):
        unpack_bits(b"\x00", 4, 3)
    with pytest.raises(ValueError, match="count"):
        unpack_bits(b"\x00", 4, -1)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_bits(b"\x00\x00", 9, 1, dtype=np.uint8)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_bits(b"\x00", 4, 1, offset=8, dtype=np.uint8)  # u − 8 can be negative


def test_unpack_reads_only_the_stream() -> None:
    """Bytes after the stream are ignored, never read into the values."""
    assert unpack_bits(b"\x21\x03\xff\xff", 4, 3).tolist() == [1, 2, 3]


def test_empty() -> None:
    for width in (1, 7, 32):
        assert pack_bits(np.zeros(0, dtype=np.int32), width).size == 0
        assert unpack_bits(b"", width, 0).size == 0
