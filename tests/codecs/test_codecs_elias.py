"""Elias omega coding: code words, the exact stream against a string reference, sizes, and a
decoder that refuses every malformed stream."""

from __future__ import annotations

import numpy as np
import pytest
from codec_strategies import SETTINGS
from hypothesis import given
from hypothesis import strategies as st

from dqsgd.codecs.elias import EliasError, elias_bit_length, elias_decode, elias_encode, omega_encode_int, omega_length
from dqsgd.codecs.elias_length import gap_bits_floor, valid_codes_bit_length


def reference_stream(codes: np.ndarray) -> str:
    """ω(nnz+1), then ω(gap) ∥ sign ∥ ω(|c|) per non-zero, as a bit string (no padding)."""
    nz = np.flatnonzero(codes)
    out = [omega_encode_int(len(nz) + 1)]
    prev = 0
    for i in nz.tolist():
        c = int(codes[i])
        out += [omega_encode_int(i + 1 - prev), "1" if c < 0 else "0", omega_encode_int(abs(c))]
        prev = i + 1
    return "".join(out)


def formula_bits(codes: np.ndarray) -> int:
    """L(nnz+1) + Σ [L(gap) + 1 + L(|c|)] from omega_length alone."""
    nz = np.flatnonzero(codes)
    gaps = np.diff(np.concatenate([[0], nz + 1]))
    return omega_length(len(nz) + 1) + sum(
        omega_length(int(g)) + 1 + omega_length(abs(int(codes[i]))) for g, i in zip(gaps, nz)
    )


def to_bytes(bits: str) -> bytes:
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))


@pytest.mark.parametrize(
    ("k", "word"), [(1, "0"), (2, "100"), (3, "110"), (4, "101000"), (7, "101110"), (8, "1110000"), (17, "10100100010")]
)
def test_omega_words(k: int, word: str) -> None:
    assert omega_encode_int(k) == word
    assert omega_length(k) == len(word)


def test_omega_length_matches_the_reference() -> None:
    ks = list(range(1, 5000)) + [2**16 - 1, 2**16, 2**31 - 1, 2**31, 2**32 - 1]
    assert [omega_length(k) for k in ks] == [len(omega_encode_int(k)) for k in ks]
    for bad in (0, -3, 2**32):
        with pytest.raises(ValueError):
            omega_length(bad)


@SETTINGS
@given(
    n=st.integers(0, 400),
    density=st.sampled_from([0.0, 0.01, 0.2, 1.0]),
    top=st.sampled_from([1, 7, 600, 5000, 2**31 - 1]),
    seed=st.integers(0, 2**32 - 1),
)
def test_stream_is_the_reference_and_round_trips(n: int, density: float, top: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    codes = rng.integers(-top, top + 1, n, dtype=np.int64)
    codes[rng.random(n) >= density] = 0
    codes = codes.astype(np.int32)
    ref = reference_stream(codes)
    body = elias_encode(codes)
    assert body.tobytes() == to_bytes(ref)
    assert elias_bit_length(codes) == len(ref) == formula_bits(codes)
    decoded, nnz = elias_decode(body.tobytes(), n, min_code=-top, max_code=top)
    assert decoded.dtype == np.int32 and np.array_equal(decoded, codes)
    assert nnz == np.count_nonzero(codes)


@SETTINGS
@given(
    n=st.integers(0, 300),
    density=st.sampled_from([0.0, 0.05, 1.0]),
    stop=st.integers(-8, 2000),
    seed=st.integers(0, 99),
)
def test_bit_length_can_stop_early(n: int, density: float, stop: int, seed: int) -> None:
    """With stop_above, the answer is exact when the stream fits, and above the limit when not."""
    rng = np.random.default_rng(seed)
    codes = np.where(rng.random(n) < density, rng.integers(-9, 10, n), 0).astype(np.int32)
    exact = elias_bit_length(codes)
    bounded = elias_bit_length(codes, stop_above=stop)
    assert bounded == exact if exact <= stop else bounded > stop


@SETTINGS
@given(
    n=st.integers(0, 400),
    density=st.sampled_from([0.0, 0.003, 0.3, 0.7, 1.0]),
    threads=st.integers(1, 5),
    wide=st.booleans(),
    seed=st.integers(0, 99),
)
def test_valid_codes_bit_length_is_elias_bit_length(n: int, density: float, threads: int, wide: bool,
                                                    seed: int) -> None:
    """The branch-free count, split into up to 5 ranges, is the formula's length: also where a gap or a
    magnitude is past the length table (4096: then its range is counted again exactly)."""
    rng = np.random.default_rng(seed)
    codes = np.where(rng.random(n) < density, rng.integers(-9, 10, n), 0).astype(np.int32)
    if wide and n:
        codes[rng.integers(0, n)] = -5000
        codes = np.concatenate([codes, np.zeros(4100, np.int32), codes[:3] + 1])
    exact = formula_bits(codes)
    assert valid_codes_bit_length(codes, threads=threads, min_per_thread=1) == exact
    for stop in (exact - 10, exact // 2, exact, exact + 1):  # one range after the other, stopping past ``stop``
        bounded = valid_codes_bit_length(codes, stop_above=stop, min_per_thread=max(1, codes.size // threads))
        assert bounded == exact if exact <= stop else bounded > stop


@SETTINGS
@given(n=st.integers(0, 300), density=st.sampled_from([0.0, 0.02, 0.3, 0.7, 1.0]), seed=st.integers(0, 99))
def test_gap_bits_floor_is_its_formula_and_a_lower_bound(n: int, density: float, seed: int) -> None:
    """Σ_(c≠0) 2[g≥2] + 3[g≥4] + [g≥8] exactly (also over the first 7 codes), and ≤ Σ_(c≠0) (L(g) − 1)."""
    rng = np.random.default_rng(seed)
    codes = np.where(rng.random(n) < density, rng.integers(-9, 10, n), 0).astype(np.int32)
    gaps = np.diff(np.concatenate([[0], np.flatnonzero(codes) + 1]))
    assert gap_bits_floor(codes) == int((2 * (gaps >= 2) + 3 * (gaps >= 4) + (gaps >= 8)).sum())
    assert gap_bits_floor(codes) <= sum(omega_length(int(g)) - 1 for g in gaps)
    assert all(omega_length(g) - 1 == 2 * (g >= 2) + 3 * (g >= 4) + (g >= 8) for g in (1, 2, 4, 8))  # tight there


def test_large_gaps_and_magnitudes() -> None:
    codes = np.zeros(3_000_000, dtype=np.int32)
    codes[[0, 70_000, 2_999_999]] = [2**31 - 1, -(2**31), 1]
    body = elias_encode(codes)
    assert body.tobytes() == to_bytes(reference_stream(codes))
    assert np.array_equal(elias_decode(body, codes.size, min_code=-(2**31), max_code=2**31 - 1)[0], codes)
    assert valid_codes_bit_length(codes, threads=3, min_per_thread=1) == elias_bit_length(codes)


def test_sparse_codes_are_much_smaller_than_fixed_width() -> None:
    """1% non-zeros at 4 bits: the measured Elias size is the formula, and far below 4 bits/elem."""
    rng = np.random.default_rng(7)
    n = 100_000
    codes = np.where(rng.random(n) < 0.01, rng.integers(-7, 8, n), 0).astype(np.int32)
    body = elias_encode(codes)
    assert len(body) == (formula_bits(codes) + 7) // 8
    fixed_bytes = n * 4 // 8
    assert len(body) < fixed_bytes / 10


def test_empty_and_all_zero_streams() -> None:
    assert elias_encode(np.zeros(0, dtype=np.int32)).tobytes() == b"\x00"  # ω(1) = "0"
    assert elias_encode(np.zeros(1000, dtype=np.int32)).tobytes() == b"\x00"
    assert elias_decode(b"\x00", 0, min_code=-1, max_code=1)[0].size == 0
    assert not elias_decode(b"\x00", 1000, min_code=-1, max_code=1)[0].any()


def test_encode_refuses_bad_codes() -> None:
    with pytest.raises(ValueError, match="integer"):
        elias_encode(np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match="2\\^32"):
        elias_encode(np.array([2**40], dtype=np.int64))
    with pytest.raises(ValueError, match="2\\^32"):
        elias_encode(np.array([-(2**63)], dtype=np.int64))


# ------------------------------------------------------------------------------------ malformed


def _valid() -> tuple[bytes, np.ndarray]:
    codes = np.array([0, 3, 0, 0, -1, 5, 0, 0, 0, -2, 0, 1], dtype=np.int32)
    return elias_encode(codes).tobytes(), codes


def test_every_truncation_is_refused() -> None:
    body, codes = _valid()
    for cut in range(len(body)):
        with pytest.raises(EliasError):
            elias_decode(body[:cut], codes.size, min_code=-7, max_code=7)


def test_trailing_bytes_and_padding_bits_are_refused() -> None:
    body, codes = _valid()
    with pytest.raises(EliasError, match="trailing"):
        elias_decode(body + b"\x00", codes.size, min_code=-7, max_code=7)
    used = len(reference_stream(codes))
    assert used % 8, "the fixture must end inside a byte"
    with pytest.raises(EliasError, match="padding"):
        elias_decode(body[:-1] + bytes([body[-1] | 1]), codes.size, min_code=-7, max_code=7)


def test_counts_gaps_and_magnitudes_are_bounded() -> None:
    with pytest.raises(EliasError, match="more non-zero"):
        elias_decode(to_bytes(omega_encode_int(5)), 3, min_code=-1, max_code=1)
    gap_past_end = omega_encode_int(2) + omega_encode_int(4) + "0" + omega_encode_int(1)
    with pytest.raises(EliasError, match="gap"):
        elias_decode(to_bytes(gap_past_end), 3, min_code=-1, max_code=1)
    too_big = omega_encode_int(2) + omega_encode_int(1) + "0" + omega_encode_int(8)
    with pytest.raises(EliasError, match="magnitude"):
        elias_decode(to_bytes(too_big), 3, min_code=-8, max_code=7)
    too_negative = omega_encode_int(2) + omega_encode_int(1) + "1" + omega_encode_int(9)
    with pytest.raises(EliasError, match="magnitude"):
        elias_decode(to_bytes(too_negative), 3, min_code=-8, max_code=7)


def test_overlong_words_never_loop() -> None:
    """All-ones input would grow ω without bound; the decoder stops at the limit."""
    for size in (1, 9, 64, 4096):
        with pytest.raises(EliasError):
            elias_decode(b"\xff" * size, 10, min_code=-7, max_code=7)


@SETTINGS
@given(data=st.binary(max_size=64), numel=st.integers(0, 40))
def test_random_streams_decode_canonically_or_raise(data: bytes, numel: int) -> None:
    try:
        codes, nnz = elias_decode(data, numel, min_code=-5, max_code=9)
    except EliasError:
        return
    assert elias_encode(codes).tobytes() == data
    assert nnz == np.count_nonzero(codes) and codes.min(initial=0) >= -5 and codes.max(initial=0) <= 9
