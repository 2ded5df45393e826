"""The payload format: exact round trips, exact sizes, the documented bytes, encode validation."""

from __future__ import annotations

import dataclasses

import math
import struct
import zlib

import numpy as np
import pytest
import torch
from codec_strategies import SETTINGS, assert_same, identity_quantized, quantized
from hypothesis import given, settings
from hypothesis import strategies as st

from dqsgd.codecs import Coding, decode, elias_encode, encode, header_size, pack_bits, predicted_size
from dqsgd.quantizers.base import RAW_SCHEMES, Layout, Norm, Quantized, Scheme

CODINGS = [Coding.FIXED, Coding.ELIAS, Coding.ZSTD, Coding.AUTO, Coding.ZSTD_ALIGNED, Coding.RANS, Coding.RANSX]


def _nseg(q: Quantized) -> int:
    return 0 if q.scheme in RAW_SCHEMES else q.layout.num_segments(q.numel)


@SETTINGS
@given(q=quantized(), coding=st.sampled_from(CODINGS))
def test_round_trip_is_exact_and_canonical(q: Quantized, coding: Coding) -> None:
    payload = encode(q, coding)
    back = decode(payload)
    assert_same(q, back)
    assert encode(back, Coding(payload[5])) == payload


@pytest.mark.parametrize("bits", range(1, 17))
@settings(SETTINGS, max_examples=8)
@given(data=st.data())
def test_every_width_round_trips(bits: int, data: st.DataObject) -> None:
    """Every width 1..16 with every coding (the generic test draws widths at random)."""
    q = data.draw(quantized(bits=st.just(bits), max_numel=97))
    for coding in CODINGS:
        payload = encode(q, coding)
        assert_same(q, decode(payload))
        assert encode(decode(payload), Coding(payload[5])) == payload


@SETTINGS
@given(q=quantized())
def test_fixed_size_is_predicted_exactly(q: Quantized) -> None:
    size = predicted_size(q.numel, q.bits, _nseg(q), len(q.shape), q.layout)
    assert len(encode(q, Coding.FIXED)) == size
    assert size == header_size(len(q.shape), q.layout, _nseg(q)) + math.ceil(q.numel * q.bits / 8) + 4


@SETTINGS
@given(q=quantized())
def test_auto_keeps_the_smallest_body(q: Quantized) -> None:
    sizes = {c: len(encode(q, c)) for c in (Coding.FIXED, Coding.ELIAS, Coding.ZSTD_ALIGNED, Coding.RANS)}
    auto = encode(q, Coding.AUTO)
    assert len(auto) == min(sizes.values())
    assert auto[5] == min(sizes, key=sizes.get)  # ties: the first of FIXED, ELIAS, ZSTD_ALIGNED, RANS
    assert auto == encode(q, Coding(auto[5]))


@SETTINGS
@given(q=identity_quantized(),
       coding=st.sampled_from([Coding.FIXED, Coding.ZSTD, Coding.AUTO, Coding.ZSTD_ALIGNED]))
def test_identity_round_trip(q: Quantized, coding: Coding) -> None:
    payload = encode(q, coding)
    assert_same(q, decode(payload))
    if payload[5] == Coding.FIXED:
        assert len(payload) == predicted_size(q.numel, 32, 0, len(q.shape), q.layout)
    with pytest.raises(ValueError, match="ELIAS"):
        encode(q, Coding.ELIAS)
    with pytest.raises(ValueError, match="RANS"):
        encode(q, Coding.RANS)


def _q(codes: list[int], *, scheme: Scheme = Scheme.UNIFORM, bits: int = 4, levels: int = 7,
       scales: list[float] | None = None, layout: Layout = Layout(), shape: tuple[int, ...] | None = None) -> Quantized:
    c = torch.tensor(codes, dtype=torch.int32)
    s = torch.tensor([2.5] if scales is None else scales, dtype=torch.float32)
    return Quantized(scheme, bits, levels, c, s, layout, shape or (len(codes),), Norm.MAX)


def test_documented_bytes_fixed() -> None:
    """The layout table, byte for byte, for a 2×3 uniform 4-bit tensor in buckets of 4."""
    q = _q([1, -7, 0, 3, 0, 7], scales=[2.5, -1.0], layout=Layout(bucket=4), shape=(2, 3))
    head = b"DQ" + bytes([2, Scheme.UNIFORM, 4, Coding.FIXED, Norm.MAX, 2 | 0 << 4]) + struct.pack("<I", 7)
    head += struct.pack("<II", 2, 3) + bytes([1]) + struct.pack("<I", 4) + struct.pack("<ff", 2.5, -1.0)
    body = bytes([(1 + 8) | (-7 + 8) << 4, (0 + 8) | (3 + 8) << 4, (0 + 8) | (7 + 8) << 4])
    unsigned = head + struct.pack("<I", len(body)) + body
    assert encode(q, Coding.FIXED) == unsigned + struct.pack("<I", zlib.crc32(unsigned))
    # dtype float16 (code 1) goes into the high nibble of the ndim byte; nothing else moves
    half = encode(dataclasses.replace(q, dtype=torch.float16), Coding.FIXED)
    unsigned16 = unsigned[:7] + bytes([2 | 1 << 4]) + unsigned[8:]
    assert half == unsigned16 + struct.pack("<I", zlib.crc32(unsigned16))


def test_documented_bytes_elias_and_sizes_layout() -> None:
    """Explicit sizes (kind 2) and the Elias body; sign codes at 1 bit pack as 1 = positive."""
    q = _q([0, 3, 0, -2, 0], layout=Layout(sizes=(2, 0, 3)), scales=[1.0, 2.0, 3.0])
    payload = encode(q, Coding.ELIAS)
    sizes = bytes([2]) + struct.pack("<IIII", 3, 2, 0, 3)
    assert payload[12 + 4 : 12 + 4 + len(sizes)] == sizes
    body = elias_encode(q.codes.numpy()).tobytes()
    assert len(body) == 3  # 17 bits: ω(3) | ω(2) 0 ω(3) | ω(2) 1 ω(2)
    assert payload[-4 - len(body) - 4 : -4] == struct.pack("<I", len(body)) + body
    s = _q([1, -1, -1, 1, 1, 1, 1, 1, -1], scheme=Scheme.SIGN, bits=1, levels=1)
    assert encode(s)[-4 - 2 : -4] == pack_bits(np.array([1, 0, 0, 1, 1, 1, 1, 1, 0]), 1).tobytes()


def test_zstd_body_is_zstd_of_the_fixed_body() -> None:
    import zstandard

    q = _q([0] * 500 + [3, -1] * 50)
    fixed, packed = encode(q, Coding.FIXED), encode(q, Coding.ZSTD)
    n = len(fixed) - 4
    fixed_body = fixed[n - 300 : n]
    zbody = packed[n - 300 : -4]
    assert zstandard.ZstdDecompressor().decompress(zbody) == fixed_body
    assert len(packed) < len(fixed)


@pytest.mark.parametrize("bits,width", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (6, 8), (7, 8), (8, 8), (9, 16),
                                        (15, 16), (16, 16)])
def test_zstd_aligned_body_is_zstd_of_the_codes_at_the_aligned_width(bits: int, width: int) -> None:
    import zstandard

    from dqsgd.codecs.header import parse_header
    from dqsgd.codecs.wire import body_width

    assert body_width(bits, Coding.ZSTD_ALIGNED) == width and body_width(bits, Coding.ZSTD) == bits
    s = 1 if bits == 1 else (1 << (bits - 1)) - 1
    codes = [(-1) ** i * min(i % 5, s) or (1 if bits == 1 else 0) for i in range(203)]
    q = _q(codes, scheme=Scheme.SIGN if bits == 1 else Scheme.UNIFORM, bits=bits, levels=s)
    payload = encode(q, Coding.ZSTD_ALIGNED)
    assert payload[5] == Coding.ZSTD_ALIGNED == 4
    h = parse_header(memoryview(payload), 1 << 20)
    zbody = payload[h.body_start : h.body_start + h.body_len]
    fields = np.array(codes) > 0 if bits == 1 else np.array(codes)
    expected = pack_bits(fields, width, offset=0 if bits == 1 else 1 << (bits - 1)).tobytes()
    assert zstandard.ZstdDecompressor().decompress(zbody) == expected
    assert_same(q, decode(payload))


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1, 1, 1, 1, 1, 1, 1, 1), (5,)])
@pytest.mark.parametrize("coding", CODINGS)
def test_edge_shapes(shape: tuple[int, ...], coding: Coding) -> None:
    n = math.prod(shape)
    q = _q([3] * n, shape=shape, scales=[1.5] if n else [])
    assert_same(q, decode(encode(q, coding)))


# ----------------------------------------------------------------------------- encode validation


@pytest.mark.parametrize(
    ("q", "match"),
    [
        (_q([1, 8]), "allows \\[-7, 7\\]"),
        (_q([1, -8], levels=7), "allows \\[-7, 7\\]"),
        (_q([9], bits=4, levels=9), "allows \\[-8, 7\\]"),
        (_q([1, 0], scheme=Scheme.SIGN, bits=1, levels=1), "zero codes"),
        (_q([1, 0], scheme=Scheme.SIGN, bits=2, levels=1), "zero codes"),
        (_q([2], scheme=Scheme.TERNARY, bits=2, levels=1), "allows \\[-1, 1\\]"),
        (_q([1], bits=0), "bits in 1..16"),
        (_q([1], bits=17), "bits in 1..16"),
        (_q([1], levels=0), "levels"),
        (_q([1], scales=[float("nan")]), "finite"),
        (_q([1], scales=[float("inf")]), "finite"),
        (_q([1, 2], scales=[1.0, 2.0]), "2 scales, but the layout has 1 segments"),
        (_q([], scales=[1.0]), "1 scales, but the layout has 0 segments for 0 elements"),
        (_q([1], layout=Layout(bucket=-2)), "bucket"),
        (_q([1, 2], layout=Layout(sizes=(1, 2))), "sum to"),
        (_q([1] * 9, shape=(1,) * 9), "ndim"),
        (_q([], shape=(0, 2**32)), "dim"),
    ],
)
def test_encode_refuses_what_the_wire_cannot_carry(q: Quantized, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode(q)


def test_encode_refuses_wrong_dtypes_and_codings() -> None:
    q = _q([1, 2])
    with pytest.raises(ValueError, match="int32"):
        encode(Quantized(q.scheme, 4, 7, q.codes.long(), q.scales, q.layout, q.shape))
    with pytest.raises(ValueError, match="float32"):
        encode(Quantized(q.scheme, 4, 7, q.codes, q.scales.double(), q.layout, q.shape))
    with pytest.raises(ValueError, match="coding"):
        encode(q, 9)  # type: ignore[arg-type]
    ident = Quantized(Scheme.IDENTITY, 16, 1, q.codes[:0], q.scales[:0], Layout(), (2,), values=torch.ones(2))
    with pytest.raises(ValueError, match="bits = 32"):
        encode(ident)


def test_predicted_size_is_only_for_fixed() -> None:
    assert predicted_size(10, 3, 1, 1, Layout()) == 12 + 4 + 1 + 4 + 4 + 4 + 4
    for coding in (Coding.ELIAS, Coding.ZSTD, Coding.AUTO, Coding.ZSTD_ALIGNED, Coding.RANS, Coding.RANSX):
        with pytest.raises(ValueError, match="FIXED"):
            predicted_size(10, 3, 1, 1, Layout(), coding)


def test_coding_ids_are_stable() -> None:
    assert [int(c) for c in CODINGS] == [0, 1, 2, 3, 4, 5, 6]
