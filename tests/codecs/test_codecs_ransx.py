"""Coding.RANSX: exact round trips, the documented body bytes (an independent reference), size bounds
within a few bytes of the actual size, and a strict decoder (every malformed body is a PayloadError).
Whole payloads round trip and re-encode to the same bytes in test_codecs_rans (both codings)."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
from codec_strategies import SETTINGS, code_bounds, random_codes
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codecs_rans import _table, reference_table

from dqsgd.codecs import Coding, PayloadError, RansError, decode, encode, ransx_decode, ransx_encode
from dqsgd.codecs.bounds import max_body_bytes, ransx_numel_bound
from dqsgd.codecs.rans import level_histogram
from dqsgd.codecs.ransx import LANES, ransx_size_bounds
from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme

M, L = 1 << 16, 1 << 31
STATES_L = struct.pack("<Q", L) * LANES


def reference_body(codes: list[int], bits: int, freq: dict[int, int] | None = None) -> bytes:
    """The documented body in plain Python (exact integer division; the table as RANS's; the
    table's frequencies :func:`normalize` of the counts, unless given)."""
    if not codes:
        return b""
    syms, freq, cum, table = reference_table(codes, bits, freq)
    xs, words = [L] * LANES, []
    for i in reversed(range(len(syms))):
        u, j = syms[i], i % LANES
        if xs[j] >= (L >> 16 << 32) * freq[u]:
            words.append(struct.pack("<I", xs[j] & 0xFFFFFFFF))
            xs[j] >>= 32
        xs[j] = (xs[j] // freq[u]) * M + xs[j] % freq[u] + cum[u]
    return table + b"".join(struct.pack("<Q", x) for x in xs) + b"".join(reversed(words))


def dec(body: bytes, n: int, bits: int, scheme: Scheme = Scheme.LOWPREC, levels: int = 1) -> np.ndarray:
    return ransx_decode(body, n, bits, *code_bounds(scheme, bits, levels))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8, 12, 16])
@settings(SETTINGS, max_examples=20)
@given(n=st.sampled_from([0, 1, 2, 7, 8, 9, 255, 1000, 5000]), seed=st.integers(0, 2**32 - 1),
       density=st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]), single=st.booleans())
def test_round_trip_and_size_bounds(bits: int, n: int, seed: int, density: float, single: bool) -> None:
    lo, hi, zero_ok = code_bounds(Scheme.LOWPREC, bits, 1)
    codes = random_codes(seed, n, lo, hi, zero_ok, density)
    if single:  # one symbol: frequency 2^16, every lane stays at L, no words
        codes[:] = codes[0] if n else 0
    hist = level_histogram(codes, bits)
    body = ransx_encode(codes, bits, hist)
    assert body.tobytes() == ransx_encode(codes, bits).tobytes()
    back = dec(body.tobytes(), n, bits)
    assert back.dtype == np.int32 and np.array_equal(back, codes)
    lo_size, hi_size = ransx_size_bounds(hist)
    assert lo_size <= body.size <= hi_size <= max_body_bytes(n, bits, Coding.RANSX)
    assert hi_size - lo_size <= 4 * LANES + 4 + n * 9e-5 / 8  # the lanes' final states, and 2^-15 per code
    if single and n:
        assert body.tobytes().endswith(STATES_L) and np.unique(codes).size == 1


@settings(SETTINGS, max_examples=150)
@given(bits=st.integers(1, 16), n=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1),
       density=st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]))
def test_body_is_the_documented_bytes(bits: int, n: int, seed: int, density: float) -> None:
    """The float quotient with its correction is exact: the bytes of integer division, every lane."""
    codes = random_codes(seed, n, *code_bounds(Scheme.LOWPREC, bits, 1), density)
    assert ransx_encode(codes, bits).tobytes() == reference_body(codes.tolist(), bits)


def test_quotient_at_the_edges_of_the_state() -> None:
    """States near 2^63 and frequencies near 2^16 and 1: where a float quotient is one off."""
    codes = np.array([0] * 40 + [1] + [0] * 3000 + [-1], dtype=np.int32)  # f near M, and two f = 1
    assert ransx_encode(codes, 2).tobytes() == reference_body(codes.tolist(), 2)
    assert np.array_equal(dec(ransx_encode(codes, 2).tobytes(), codes.size, 2), codes)


def test_names() -> None:
    assert Coding.from_name("ransx") == Coding.RANSX == Coding.from_name("RANSX")


GOOD = [0, 0, 0, 1, 0, -1, 0, 0, 2, 0, 0, 0, 0, 0, 1, 0] * 8  # 128 codes at 4 bits: words in every lane


def good_body() -> bytes:
    return ransx_encode(np.array(GOOD, dtype=np.int32), 4).tobytes()


def test_every_truncation_and_padding_is_refused() -> None:
    body = good_body()
    assert dec(body, len(GOOD), 4).tolist() == GOOD
    for cut in range(len(body)):
        with pytest.raises(RansError):
            dec(body[:cut], len(GOOD), 4)
    for extra in (b"\x00", b"\xff\x01\x00\x00", body[-4:]):
        with pytest.raises(RansError, match="trailing bytes|final state"):
            dec(body + extra, len(GOOD), 4)


def test_every_byte_change_is_refused_or_canonical() -> None:
    body = bytearray(good_body())
    for i in range(len(body)):
        for v in (0x00, 0x01, 0x7F, 0x80, 0xFF, body[i] ^ 0x10):
            if v == body[i]:
                continue
            forged = bytearray(body)
            forged[i] = v
            try:
                codes = dec(bytes(forged), len(GOOD), 4)
            except RansError:
                continue
            assert ransx_encode(codes, 4).tobytes() == bytes(forged)


@pytest.mark.parametrize(
    ("body", "n", "match"),
    [
        (_table([(8, M)]) + STATES_L, 0, "empty tensor"),
        (_table([(8, M)], k=17) + STATES_L, 100, "symbol count"),
        (_table([(8, M - 1)]) + STATES_L, 4, "do not sum"),
        (_table([(8, M)]) + struct.pack("<Q", L - 1) + STATES_L[8:], 4, "initial state"),
        (_table([(8, M)]) + STATES_L[:-1] + b"\x80", 4, "initial state"),  # ≥ 2^63
        (_table([(8, M)]) + struct.pack("<Q", L + 1) + STATES_L[8:], 4, "final state"),
        (_table([(8, M)]) + STATES_L + b"\x00\x00\x00\x00", 4, "trailing bytes"),
        (_table([(8, M)]) + STATES_L[:-1], 4, "stream truncated"),
        (_table([(8, M // 2), (0, M // 2)]) + STATES_L, 4, "stream truncated"),
        (reference_body([0] * 16, 4, {8: M - 1, 9: 1}), 16, "never occurs"),
        (reference_body([0, 0, 0, 1] * 4, 4, {8: M // 2, 9: M // 2}), 16, "not the normalised counts"),
    ],
)
def test_forged_bodies(body: bytes, n: int, match: str) -> None:
    with pytest.raises(RansError, match=match):
        dec(body, n, 4)


def test_payload_errors_name_the_body_and_forged_numel_is_bounded() -> None:
    q = Quantized(Scheme.UNIFORM, 4, 7, torch.tensor(GOOD, dtype=torch.int32), torch.ones(1), Layout(), (len(GOOD),),
                  Norm.MAX)
    payload = bytearray(encode(q, Coding.RANSX))
    payload[-5] ^= 0x01  # the last stream word, crc recomputed: the stream check must catch it
    payload[-4:] = struct.pack("<I", zlib.crc32(bytes(payload[:-4])))
    with pytest.raises(PayloadError, match="RANSX body at offset"):
        decode(bytes(payload))
    good = encode(q, Coding.RANSX)
    body_len = len(good_body())
    forged = bytearray(good[:-4])
    forged[12:16] = struct.pack("<I", ransx_numel_bound(body_len) + 1)  # the one dim: numel
    forged += struct.pack("<I", zlib.crc32(bytes(forged)))
    with pytest.raises(PayloadError, match="RANSX body at offset .* carry fewer than"):
        decode(bytes(forged), max_numel=2**28)


def test_forged_one_symbol_body_is_refused() -> None:
    n = 3 * 2**20
    q = Quantized(Scheme.UNIFORM, 4, 7, torch.full((n,), -3, dtype=torch.int32), torch.ones(1), Layout(), (n,),
                  Norm.MAX)
    good = encode(q, Coding.RANSX)
    assert torch.equal(decode(good).codes, q.codes)
    forged = bytearray(good[:-4])
    forged[-1] ^= 0x01  # the last lane's state is not L
    forged += struct.pack("<I", zlib.crc32(bytes(forged)))
    with pytest.raises(PayloadError, match="RANSX body at offset .* in every lane"):
        decode(bytes(forged))


@pytest.mark.parametrize(("codes", "freq", "match"), [([0] * 16, {8: M - 1, 9: 1}, "never occurs"),
                                                      ([0, 0, 0, 1] * 4, {8: M // 2, 9: M // 2}, "not the normalised")])
def test_decode_accumulate_refuses_a_table_that_is_not_the_counts(codes: list[int], freq: dict[int, int],
                                                                  match: str) -> None:
    """decode-accumulate checks the table from the counts it takes while adding the codes: it refuses
    the forged tables decode refuses, with the same error."""
    from dqsgd.codecs.header import write_header
    from dqsgd.kernels import decode_accumulate

    body = reference_body(codes, 4, freq)
    payload = write_header(Scheme.UNIFORM, 4, Coding.RANSX, Norm.MAX, 7, (16,), Layout(), np.ones(1, np.float32),
                           len(body)) + body
    payload += struct.pack("<I", zlib.crc32(payload))
    for run in (decode, lambda p: decode_accumulate(p, torch.zeros(16))):
        with pytest.raises(PayloadError, match=f"RANSX body at offset .*{match}"):
            run(payload)
