"""Coding.RANS: exact round trips, the documented body bytes, coded size against the entropy, and a
strict decoder (every malformed table or stream is a PayloadError)."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from codec_strategies import SETTINGS, assert_same, code_bounds, quantized, random_codes
from hypothesis import given, settings
from hypothesis import strategies as st

from dqsgd.codecs import Coding, PayloadError, RansError, decode, encode, rans_decode, rans_encode
from dqsgd.codecs.rans import level_histogram, normalize, rans_size_bounds
from dqsgd.method.config import method_config
from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme

M, L = 1 << 16, 1 << 23


# ------------------------------------------------------------------- an independent reference


def varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    return bytes(out + bytes([v]))


def reference_table(codes: list[int], bits: int,
                    freq: dict[int, int] | None) -> tuple[list[int], dict[int, int], dict[int, int], bytes]:
    """(symbols u of the codes, frequency and cumulative frequency per symbol, the table's bytes), in
    plain Python (the frequencies: :func:`normalize` of the counts, unless given)."""
    off = 0 if bits == 1 else 1 << (bits - 1)
    syms = [int(c > 0) if bits == 1 else c + off for c in codes]
    present = sorted(set(syms) if freq is None else freq)
    if freq is None:
        freq = dict(zip(present, normalize(np.array([syms.count(u) for u in present])).tolist()))
    cum, acc = {}, 0
    for u in present:
        cum[u], acc = acc, acc + freq[u]
    table, prev = varint(len(present)), -1
    for u in present:
        table += varint(u - prev - 1) + varint(freq[u])
        prev = u
    return syms, freq, cum, table


def reference_body(codes: list[int], bits: int, freq: dict[int, int] | None = None) -> bytes:
    """The documented body, in plain Python (the table: :func:`normalize` of the counts, unless given)."""
    if not codes:
        return b""
    syms, freq, cum, table = reference_table(codes, bits, freq)
    x, emitted = L, bytearray()
    for u in reversed(syms):
        while x >= (L >> 16 << 8) * freq[u]:
            emitted.append(x & 0xFF)
            x >>= 8
        x = (x // freq[u]) * M + x % freq[u] + cum[u]
    return table + struct.pack("<I", x) + bytes(reversed(emitted))


def bounds(bits: int, scheme: Scheme = Scheme.LOWPREC, levels: int = 1) -> tuple[int, int, bool]:
    return code_bounds(scheme, bits, levels)


def dec(body: bytes, n: int, bits: int, scheme: Scheme = Scheme.LOWPREC, levels: int = 1) -> np.ndarray:
    return rans_decode(body, n, bits, *bounds(bits, scheme, levels))


# ------------------------------------------------------------------- round trips


@pytest.mark.parametrize("bits", range(1, 17))
@settings(SETTINGS, max_examples=25)
@given(n=st.sampled_from([0, 1, 2, 3, 17, 255, 1000, 5000]), seed=st.integers(0, 2**32 - 1),
       density=st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]), single=st.booleans())
def test_round_trip_every_width(bits: int, n: int, seed: int, density: float, single: bool) -> None:
    lo, hi, zero_ok = bounds(bits)
    codes = random_codes(seed, n, lo, hi, zero_ok, density)
    if single:  # one symbol: the table is one entry of frequency 2^16 and the stream is empty
        codes[:] = codes[0] if n else 0
    body = rans_encode(codes, bits)
    back = dec(body.tobytes(), n, bits)
    assert back.dtype == np.int32 and np.array_equal(back, codes)
    if single and n:
        assert body.size == len(varint(1)) + len(varint(int(codes[0]) + (1 << (bits - 1)) if bits > 1 else 0)) + 3 + 4


@settings(SETTINGS, max_examples=200)
@given(bits=st.integers(1, 16), n=st.integers(0, 60), seed=st.integers(0, 2**32 - 1),
       density=st.sampled_from([0.0, 0.1, 0.5, 1.0]))
def test_body_is_the_documented_bytes(bits: int, n: int, seed: int, density: float) -> None:
    codes = random_codes(seed, n, *bounds(bits), density)
    assert rans_encode(codes, bits).tobytes() == reference_body(codes.tolist(), bits)


@settings(SETTINGS, max_examples=30)
@given(bits=st.integers(1, 16), n=st.integers(61, 4000), seed=st.integers(0, 2**32 - 1),
       density=st.sampled_from([0.001, 0.02, 0.3, 1.0]))
def test_division_free_encoder_is_the_documented_bytes(bits: int, n: int, seed: int, density: float) -> None:
    """Longer bodies: rare symbols of frequency 1, two renormalisation bytes, every reciprocal shift."""
    codes = random_codes(seed, n, *bounds(bits), density)
    assert rans_encode(codes, bits).tobytes() == reference_body(codes.tolist(), bits)


@settings(SETTINGS, max_examples=60)
@given(bits=st.integers(1, 16), n=st.integers(0, 20_000), seed=st.integers(0, 2**32 - 1),
       density=st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]))
def test_size_bounds_hold_and_the_histogram_can_be_given(bits: int, n: int, seed: int, density: float) -> None:
    codes = random_codes(seed, n, *bounds(bits), density)
    hist = level_histogram(codes, bits)
    body = rans_encode(codes, bits, hist)
    assert body.tobytes() == rans_encode(codes, bits).tobytes()
    lo, hi = rans_size_bounds(hist)
    assert lo <= body.size <= hi
    assert hi - lo <= 4 + n * 0.0227 / 8  # the state's rounding: within ±log2(1 ± 2^-7) bits per code


@pytest.mark.parametrize("bits", [8, 9, 16])
def test_every_symbol_of_a_width(bits: int) -> None:
    """K = 2^b symbols at 8 bits fill the decoder's one-byte slot table (index 255); wider ones use two bytes."""
    lo, hi, _ = bounds(bits)
    k = min(hi - lo + 1, 4096)
    codes = np.repeat(np.arange(lo, lo + k, dtype=np.int32), 3)
    np.random.default_rng(bits).shuffle(codes)
    assert np.array_equal(dec(rans_encode(codes, bits).tobytes(), codes.size, bits), codes)


def test_documented_bytes_by_hand() -> None:
    # codes 0, 0, 0, 1 at 2 bits: symbols u = 2 (×3) and 3 (×1) → frequencies 49152 and 16384.
    body = rans_encode(np.array([0, 0, 0, 1], dtype=np.int32), 2).tobytes()
    table = bytes([2, 2, 0x80, 0x80, 0x03, 0, 0x80, 0x80, 0x01])
    assert body[: len(table)] == table and len(body) == len(table) + 4
    assert body == reference_body([0, 0, 0, 1], 2)
    assert rans_encode(np.zeros(0, dtype=np.int32), 4).size == 0  # empty tensor: empty body


@pytest.mark.parametrize(("coding", "wire_id"), [(Coding.RANS, 5), (Coding.RANSX, 6)])
@SETTINGS
@given(q=quantized(max_numel=500))
def test_payload_round_trip_and_canonical(coding: Coding, wire_id: int, q: Quantized) -> None:
    payload = encode(q, coding)
    assert payload[5] == coding == wire_id
    back = decode(payload)
    assert_same(q, back)
    assert encode(back, coding) == payload


def test_names() -> None:
    assert Coding.from_name("rans") == Coding.RANS == Coding.from_name("RANS")
    assert method_config("qsgd", bits=4, coding="rans").coding == "rans"


# ------------------------------------------------------------------- normalisation


@settings(SETTINGS, max_examples=300)
@given(counts=st.lists(st.integers(1, 2**32 - 1), min_size=1, max_size=300) | st.lists(
    st.integers(1, 5), min_size=1, max_size=3000))
def test_normalize_sums_to_the_total_and_keeps_the_order(counts: list[int]) -> None:
    c = np.array(counts, dtype=np.int64)
    f = normalize(c)
    assert f.sum() == M and f.min() >= 1
    for v in np.unique(c)[:-1]:  # a more frequent symbol never gets a smaller frequency
        assert f[c == v].max() <= f[c > v].min()
    for v in np.unique(c):  # equal counts: frequencies at most 1 apart
        assert np.ptp(f[c == v]) <= 1


def test_normalize_extremes() -> None:
    assert normalize(np.array([7])).tolist() == [M]
    assert normalize(np.ones(M, dtype=np.int64)).tolist() == [1] * M
    f = normalize(np.array([10**9] + [1] * (M - 1)))
    assert f.tolist() == [1] * M  # 65536 symbols: every one gets 1, however skewed
    f = normalize(np.array([10**6, 1, 1, 1]))
    assert f.tolist() == [M - 3, 1, 1, 1]
    with pytest.raises(ValueError):
        normalize(np.array([1, 0]))
    with pytest.raises(ValueError):
        normalize(np.ones(M + 1, dtype=np.int64))


# ------------------------------------------------------------------- size against the entropy


def _entropy_bits(codes: np.ndarray) -> float:
    counts = np.unique(codes, return_counts=True)[1]
    p = counts / codes.size
    return float(-(counts * np.log2(p)).sum())


def _table_bytes(codes: np.ndarray, bits: int) -> int:
    body = rans_encode(codes, bits).tobytes()
    k = len(np.unique(codes))
    # K varint + K × (gap, freq) varints: re-read the lengths from the body itself.
    p, vals = 0, []
    while len(vals) < 1 + 2 * k:
        start = p
        while body[p] & 0x80:
            p += 1
        p += 1
        vals.append(p - start)
    return p


SKEWED = {
    "p0=0.95, ±1 (2 bits)": (2, lambda r, n: (r.random(n) < 0.05) * r.choice([-1, 1], n)),
    "p0=0.99, ±1..3 (4 bits)": (4, lambda r, n: (r.random(n) < 0.01) * r.integers(-3, 4, n)),
    "geometric |c| (8 bits)": (8, lambda r, n: np.clip(r.geometric(0.3, n) - 1, 0, 127) * r.choice([-1, 1], n)),
    "gaussian σ=20 (8 bits)": (8, lambda r, n: np.clip(np.round(r.standard_normal(n) * 20), -128, 127)),
    "two symbols, p=0.999 (1 bit)": (1, lambda r, n: np.where(r.random(n) < 0.999, 1, -1)),
    "all zero (4 bits)": (4, lambda r, n: np.zeros(n)),
}


@pytest.mark.parametrize("name", list(SKEWED))
def test_coded_size_approaches_the_entropy(name: str) -> None:
    """Stream ≤ Σ log2(M/f) + n·log2(1 + 2^-7) + 32 bits (module docstring: a proof), and so, for
    large i.i.d. samples whose normalised frequencies are close to the counts, ≤ 1.01·n·H + 64 bits."""
    bits, draw = SKEWED[name]
    n = 400_000
    codes = draw(np.random.default_rng(7), n).astype(np.int32)
    body = rans_encode(codes, bits)
    table = _table_bytes(codes, bits)
    stream_bits = 8 * (body.size - table)  # state + renormalisation bytes
    h = _entropy_bits(codes)
    _, counts = np.unique(codes, return_counts=True)
    model = float((counts * np.log2(M / normalize(counts))).sum())
    assert stream_bits <= model + n * math.log2(1 + 2**-7) + 32 + 8
    assert stream_bits <= 1.01 * h + 64
    assert 8 * body.size <= 1.02 * h + 8 * table + 64  # the bar: within 2% + the table
    assert table <= 1 + 6 * len(counts)


def test_much_smaller_than_zstd_on_sparse_codes() -> None:
    rng = np.random.default_rng(1)
    codes = ((rng.random(100_000) < 0.05) * rng.choice([-1, 1], 100_000)).astype(np.int32)
    q = Quantized(Scheme.UNIFORM, 2, 1, torch.from_numpy(codes), torch.ones(1), Layout(), (100_000,), Norm.MAX)
    sizes = {c: len(encode(q, c)) for c in (Coding.FIXED, Coding.ELIAS, Coding.ZSTD_ALIGNED, Coding.RANS)}
    assert sizes[Coding.RANS] < 0.8 * min(sizes[Coding.ELIAS], sizes[Coding.ZSTD_ALIGNED])
    assert encode(q, Coding.AUTO)[5] == Coding.RANSX  # 100,000 codes: AUTO's rANS candidate is RANSX


# ------------------------------------------------------------------- a strict decoder


GOOD = [0, 0, 0, 1, 0, -1, 0, 0, 2, 0, 0, 0, 0, 0, 1, 0]  # 16 codes at 4 bits


def good_body() -> bytes:
    return rans_encode(np.array(GOOD, dtype=np.int32), 4).tobytes()


def test_good_body_decodes() -> None:
    assert dec(good_body(), 16, 4).tolist() == GOOD


def test_every_truncation_and_padding_is_refused() -> None:
    body = good_body()
    for cut in range(len(body)):
        with pytest.raises(RansError):
            dec(body[:cut], 16, 4)
    for extra in (b"\x00", b"\xff\x01", body[-4:]):
        with pytest.raises(RansError, match="trailing bytes|final state"):
            dec(body + extra, 16, 4)


def test_every_byte_change_is_refused_or_canonical() -> None:
    """Any single-byte change either fails or decodes to codes that re-encode to exactly that body."""
    body = bytearray(good_body())
    for i in range(len(body)):
        for v in range(256):
            if v == body[i]:
                continue
            forged = bytearray(body)
            forged[i] = v
            try:
                codes = dec(bytes(forged), 16, 4)
            except RansError:
                continue
            assert rans_encode(codes, 4).tobytes() == bytes(forged)


def _table(entries: list[tuple[int, int]], k: int | None = None) -> bytes:
    out = varint(len(entries) if k is None else k)
    for gap, f in entries:
        out += varint(gap) + varint(f)
    return out


STATE_L = struct.pack("<I", L)


@pytest.mark.parametrize(
    ("body", "n", "match"),
    [
        (_table([(8, M)]) + STATE_L, 0, "empty tensor"),
        (_table([], k=0) + STATE_L, 4, "symbol count"),
        (_table([(8, M)], k=2) + STATE_L, 1, "symbol count"),  # K > n
        (_table([(8, M)], k=17) + STATE_L, 100, "symbol count"),  # K > 2^bits
        (varint(1) + b"\x88\x80\x80\x80" + STATE_L, 4, "malformed varint"),  # 4-byte varint
        (varint(1) + b"\x88\x00" + varint(M) + STATE_L, 4, "malformed varint"),  # not minimal
        (varint(1) + varint(8) + b"\x80\x80", 4, "table truncated"),
        (_table([(16, M)]) + STATE_L, 4, "out of range for the bit width"),
        (_table([(0, M - 1), (15, 1)]) + STATE_L, 4, "out of range for the bit width"),
        (_table([(8, 0)]) + STATE_L, 4, "frequency out of range"),
        (_table([(8, M + 1)]) + STATE_L, 4, "frequency out of range"),
        (_table([(8, M - 1)]) + STATE_L, 4, "do not sum"),
        (_table([(7, M), (0, 1)]) + STATE_L, 4, "do not sum"),
        (_table([(8, M)]) + struct.pack("<I", L - 1), 4, "initial state"),
        (_table([(8, M)]) + struct.pack("<I", L << 8), 4, "initial state"),
        (_table([(8, M)]) + struct.pack("<I", L + 1), 4, "final state"),
        (_table([(8, M)]) + STATE_L + b"\x00", 4, "trailing bytes"),
        (_table([(8, M)]) + STATE_L[:3], 4, "stream truncated"),
        (_table([(8, M // 2), (0, M // 2)]) + STATE_L, 4, "stream truncated"),
        (reference_body([0, 0, 0, 0], 4, {8: M - 1, 9: 1}), 4, "never occurs"),
        (reference_body([0, 0, 0, 1], 4, {8: M // 2, 9: M // 2}), 4, "not the normalised counts"),
    ],
)
def test_forged_bodies(body: bytes, n: int, match: str) -> None:
    with pytest.raises(RansError, match=match):
        dec(body, n, 4)


def test_scheme_range_is_checked_in_the_table() -> None:
    body = rans_encode(np.array([0, 5, 0], dtype=np.int32), 4).tobytes()
    assert dec(body, 3, 4, Scheme.UNIFORM, 5).tolist() == [0, 5, 0]
    with pytest.raises(RansError, match="scheme does not allow"):
        dec(body, 3, 4, Scheme.UNIFORM, 4)
    zeros = rans_encode(np.array([0, 1, -1], dtype=np.int32), 2).tobytes()
    with pytest.raises(RansError, match="scheme does not allow"):
        dec(zeros, 3, 2, Scheme.SIGN)  # SIGN at 2 bits: no zero codes


def test_payload_errors_name_the_body() -> None:
    q = Quantized(Scheme.UNIFORM, 4, 7, torch.tensor(GOOD, dtype=torch.int32), torch.ones(1), Layout(), (16,),
                  Norm.MAX)
    payload = bytearray(encode(q, Coding.RANS))
    payload[-5] ^= 0x01  # last stream byte, crc recomputed: the stream check must catch it
    import zlib
    payload[-4:] = struct.pack("<I", zlib.crc32(bytes(payload[:-4])))
    with pytest.raises(PayloadError, match="RANS body at offset"):
        decode(bytes(payload))
    ident = bytearray(encode(q, Coding.RANS))
    ident[3], ident[4] = Scheme.IDENTITY, 32
    with pytest.raises(PayloadError):
        decode(bytes(ident[:-4]) + struct.pack("<I", zlib.crc32(bytes(ident[:-4]))))


def test_forged_numel_allocates_only_the_output() -> None:
    """One symbol codes any numel in a few bytes: the decoder allocates numel codes (bounded by
    the header's max_numel), never from the body's fields."""
    import tracemalloc

    body = _table([(8, M)]) + STATE_L
    tracemalloc.start()
    try:
        assert not dec(body, 1 << 20, 4).any()
        assert tracemalloc.get_traced_memory()[1] < 5 << 20
    finally:
        tracemalloc.stop()
