"""Malformed payloads: every one raises PayloadError, quickly, before allocating anything big."""

from __future__ import annotations

import struct
import time
import tracemalloc
import zlib

import numpy as np
import pytest
import torch
import zstandard
from codec_strategies import SETTINGS, identity_quantized, quantized
from hypothesis import given
from hypothesis import strategies as st

from dqsgd.codecs import Coding, PayloadError, decode, elias_encode, encode, pack_bits
from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme


def seal(unsigned: bytes) -> bytes:
    return unsigned + struct.pack("<I", zlib.crc32(unsigned))


def reseal(payload: bytes | bytearray) -> bytes:
    """Recompute the crc, so that a forged field reaches the checks behind it."""
    return seal(bytes(payload[:-4]))


def forge(
    *, magic: bytes = b"DQ", version: int = 2, scheme: int = 1, bits: int = 4, coding: int = 0, norm: int = 255,
    dims: tuple[int, ...] = (5,), levels: int = 7, layout: bytes = b"\x00", scales: tuple[float, ...] = (1.0,),
    body: bytes = b"\x88\x88\x08", body_len: int | None = None,
) -> bytes:
    """A payload built field by field from the documented layout, with a valid crc."""
    head = magic + bytes([version, scheme, bits, coding, norm, len(dims)]) + struct.pack("<I", levels)
    head += struct.pack(f"<{len(dims)}I", *dims) + layout + struct.pack(f"<{len(scales)}f", *scales)
    return seal(head + struct.pack("<I", len(body) if body_len is None else body_len) + body)


def _zstd(data: bytes, size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=size).compress(data)


def small(coding: Coding) -> bytes:
    codes = torch.tensor([0, 3, -7, 0, 0, 1, 0, 7, -1, 0, 0, 0, 2], dtype=torch.int32)
    q = Quantized(Scheme.UNIFORM, 4, 7, codes, torch.tensor([1.0, -2.0, 0.5]), Layout(sizes=(6, 0, 7)), (13,), Norm.L2)
    return encode(q, coding)


def test_forge_matches_encode() -> None:
    """The forging helper writes the documented layout: a sanity check for the tests below."""
    q = Quantized(Scheme.UNIFORM, 4, 7, torch.zeros(5, dtype=torch.int32), torch.ones(1), Layout(), (5,), Norm.MAX)
    assert forge() == encode(q)
    assert decode(forge()).codes.tolist() == [0] * 5


@pytest.mark.parametrize("coding", [Coding.FIXED, Coding.ELIAS, Coding.ZSTD, Coding.ZSTD_ALIGNED, Coding.RANS, Coding.RANSX])
def test_every_truncation_is_refused(coding: Coding) -> None:
    payload = small(coding)
    for cut in range(len(payload)):
        with pytest.raises(PayloadError):
            decode(payload[:cut])


@pytest.mark.parametrize("coding", [Coding.FIXED, Coding.ELIAS, Coding.ZSTD, Coding.ZSTD_ALIGNED, Coding.RANS, Coding.RANSX])
def test_padding_is_refused(coding: Coding) -> None:
    payload = small(coding)
    for extra in (b"\x00", b"\x00" * 4, payload[-4:]):
        with pytest.raises(PayloadError, match="extra bytes"):
            decode(payload + extra)


@pytest.mark.parametrize("coding", [Coding.FIXED, Coding.ELIAS, Coding.ZSTD, Coding.ZSTD_ALIGNED, Coding.RANS, Coding.RANSX])
def test_every_bit_flip_is_refused(coding: Coding) -> None:
    payload = small(coding)
    for bit in range(8 * len(payload)):
        flipped = bytearray(payload)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(PayloadError):
            decode(bytes(flipped))


def test_crc_mismatch_says_so() -> None:
    payload = bytearray(small(Coding.FIXED))
    payload[-6] ^= 0x10
    with pytest.raises(PayloadError, match="crc mismatch"):
        decode(bytes(payload))


def test_foreign_and_newer_payloads() -> None:
    with pytest.raises(PayloadError, match="not a dqsgd payload"):
        decode(b"PK\x03\x04" + bytes(40))
    with pytest.raises(PayloadError, match="truncated"):
        decode(b"")
    with pytest.raises(PayloadError, match=r"payload format version 3 is newer than this dqsgd \(2\)"):
        decode(forge(version=3))
    with pytest.raises(PayloadError, match="version 3 is newer"):
        decode(b"DQ\x03")  # even when too short for a version-2 header
    with pytest.raises(PayloadError, match="unknown payload format version 0"):
        decode(forge(version=0))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"scheme": 9}, "unknown scheme 9 at offset 3"),
        ({"coding": 7}, "unknown coding 7 at offset 5"),
        ({"coding": 3}, "AUTO"),
        ({"norm": 5}, "unknown norm 5 at offset 6"),
        ({"dims": (1,) * 9}, "ndim 9"),
        ({"layout": b"\x03"}, "unknown layout kind 3"),
        ({"layout": b"\x01" + struct.pack("<I", 0)}, "bucket size 0"),
        ({"layout": b"\x02" + struct.pack("<III", 2, 2, 2)}, "sum to 4"),
        ({"bits": 17}, "bits in 1..16"),
        ({"bits": 0}, "bits in 1..16"),
        ({"levels": 0}, "levels"),
        ({"scheme": 0, "bits": 16, "scales": ()}, "IDENTITY needs bits = 32"),
        ({"scales": (float("nan"),)}, "non-finite scale"),
        ({"scales": (float("-inf"),)}, "non-finite scale"),
        ({"body": b"\x88\x88"}, "need 3"),
        ({"body": b"\x88\x88\x08\x00"}, "need 3"),
        ({"body": b"\x88\x88\x88"}, "padding bits"),
        ({"body": b"\x80\x88\x08"}, "allows \\[-7, 7\\]"),  # u = 0 is −8 at 4 bits: not uniform
        ({"levels": 3, "body": b"\x8d\x88\x08"}, "span \\[0, 5\\]"),
        ({"scheme": 3, "bits": 2, "levels": 1, "body": b"\x00\x00"}, "allows \\[-1, 1\\]"),
        ({"scheme": 2, "bits": 2, "levels": 1, "body": b"\xaa\x02"}, "zero codes"),
        ({"coding": 1, "body": b"\x00\x00"}, "trailing bytes"),
        ({"coding": 1, "body": b"\x01"}, "padding bits"),
        ({"coding": 1, "body": b""}, "stream ends"),
        ({"coding": 1, "scheme": 0, "bits": 32, "scales": (), "body": b"\x00"}, "IDENTITY payload with ELIAS"),
        ({"coding": 1, "scheme": 2, "bits": 1, "levels": 1, "body": b"\x00"}, "zero codes"),
        ({"coding": 2, "body": b"\x88\x88\x08"}, "not a zstd frame"),
        ({"coding": 2, "body": _zstd(b"\x88\x88\x08", size=False)}, "declares"),
        ({"coding": 2, "body": _zstd(b"\x88\x88\x08\x88")}, "declares 4 bytes"),
        ({"coding": 2, "body": _zstd(b"\x88\x88\x08") + b"\x00"}, "trailing data"),
        ({"coding": 2, "body": _zstd(b"\x88\x88\x08") + _zstd(b"")}, "trailing data"),
        ({"coding": 2, "body": _zstd(b"\x88\x88\x18")}, "padding bits"),
        # ZSTD_ALIGNED at 3 bits: 4-bit fields; a set high bit is a code out of range, not padding.
        ({"coding": 4, "bits": 3, "levels": 3, "body": _zstd(b"\xf4\x44\x04")}, "span \\[0, 11\\]"),
        ({"coding": 4, "bits": 3, "levels": 3, "body": _zstd(b"\x44\x44\x14")}, "padding bits"),
        ({"coding": 4, "bits": 3, "levels": 3, "body": _zstd(b"\x24\x49")}, "declares 2 bytes, expected 3"),
        ({"coding": 4, "bits": 6, "levels": 31, "body": _zstd(bytes([32, 33, 31, 0, 63]))}, "span \\[-32, 31\\]"),
        ({"coding": 4, "bits": 6, "levels": 31, "body": _zstd(bytes([32, 33, 31, 64, 32]))}, "span \\[-1, 32\\]"),
        ({"coding": 4, "body": b"\x88\x88\x08"}, "not a zstd frame"),
    ],
)
def test_forged_fields_are_refused(fields: dict, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        decode(forge(**fields))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"dims": (2**32 - 1,) * 8}, "max_numel"),
        ({"dims": (2**28 + 1,)}, "max_numel"),
        ({"dims": (2**28,), "layout": b"\x01" + struct.pack("<I", 1)}, "scales needs"),
        ({"layout": b"\x02" + struct.pack("<I", 2**32 - 1)}, "segment sizes needs"),
        ({"body_len": 2**32 - 1}, "truncated"),
        # A ZSTD_ALIGNED frame of L bytes holds ≤ 2^17·⌊(L − 6)/3⌋ bytes: checked before decompressing.
        ({"coding": 4, "bits": 6, "levels": 31, "dims": (2**26,), "body": _zstd(b"\x20")},
         "cannot decompress to the 67108864 bytes"),
    ],
)
def test_forged_sizes_are_refused_before_allocation(fields: dict, match: str) -> None:
    payload = forge(**fields)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(PayloadError, match=match):
            decode(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 0.5
    assert peak < 1 << 20, f"decode allocated {peak} bytes before refusing"


def test_max_numel_is_the_callers_cap() -> None:
    payload = forge()
    assert decode(payload, max_numel=5).numel == 5
    with pytest.raises(PayloadError, match="max_numel=4"):
        decode(payload, max_numel=4)


def test_elias_refuses_more_than_u32_elements() -> None:
    payload = forge(coding=1, dims=(2**16, 2**16), body=b"\x00")
    with pytest.raises(PayloadError, match="2\\^32"):
        decode(payload, max_numel=1 << 40)


def test_decode_takes_any_bytes_like() -> None:
    payload = small(Coding.ELIAS)
    for buf in (payload, bytearray(payload), memoryview(payload), np.frombuffer(payload, dtype=np.uint8)):
        assert decode(buf).codes.tolist() == decode(payload).codes.tolist()


# ------------------------------------------------------------------------------------------ fuzz


def _check_canonical(payload: bytes) -> None:
    """Decode either raises PayloadError or gives a Quantized that re-encodes to the same bytes
    (ZSTD frames may be valid in more than one form: there the content must survive)."""
    try:
        q = decode(payload, max_numel=4096)
    except PayloadError:
        return
    again = encode(q, Coding(payload[5]))
    if payload[5] in (Coding.ZSTD, Coding.ZSTD_ALIGNED):
        assert decode(again).codes.tolist() == q.codes.tolist()
    elif payload[2] == 1:  # a (mutated into a) version 1 payload is written back as version 2: only the
        assert again == reseal(payload[:2] + b"\x02" + payload[3:])  # version byte and the crc differ
    else:
        assert again == payload


@SETTINGS
@given(data=st.binary(max_size=80))
def test_random_bytes(data: bytes) -> None:
    _check_canonical(data)
    _check_canonical(reseal(b"DQ\x01" + data + b"\x00\x00\x00\x00"))


@SETTINGS
@given(
    q=quantized(max_numel=40),
    coding=st.sampled_from([Coding.FIXED, Coding.ELIAS, Coding.ZSTD, Coding.ZSTD_ALIGNED, Coding.RANS, Coding.RANSX]),
    resealed=st.booleans(),
    cut=st.integers(0, 3),
    data=st.data(),
)
def test_mutated_payloads(q: Quantized, coding: Coding, resealed: bool, cut: int, data: st.DataObject) -> None:
    """Overwrite 1-4 bytes (after the magic and version half of the time, to reach deeper checks),
    optionally fix the crc, optionally cut or pad."""
    _check_canonical(_mutated(encode(q, coding), resealed, cut, data))


def _mutated(payload: bytes, resealed: bool, cut: int, data: st.DataObject) -> bytes:
    out = bytearray(payload)
    first = data.draw(st.sampled_from([0, 3]))
    for _ in range(data.draw(st.integers(1, 4))):
        out[data.draw(st.integers(first, len(out) - 1))] = data.draw(st.integers(0, 255))
    if cut:
        out = out[: len(out) - cut] if cut < 3 else out + b"\x00"
    return reseal(out) if resealed else bytes(out)


def test_elias_body_matches_encoder_inside_payload() -> None:
    """Cross-check: the ELIAS body in the payload is exactly elias_encode of the codes."""
    codes = np.zeros(13, dtype=np.int32)
    codes[[1, 2, 5, 7, 8, 12]] = [3, -7, 1, 7, -1, 2]
    body = elias_encode(codes).tobytes()
    assert small(Coding.ELIAS)[-4 - len(body) : -4] == body
    assert small(Coding.FIXED)[-4 - 7 : -4] == pack_bits(codes, 4, offset=8).tobytes()


def test_identity_body_with_nan_refused_even_with_a_valid_crc() -> None:
    """Found by benchmarks/fuzz_decode.py: a mutated fp32 body whose CRC was recomputed."""
    import struct
    import zlib

    import torch

    from dqsgd.codecs import PayloadError, decode, encode
    from dqsgd.quantizers import quantize_identity

    p = bytearray(encode(quantize_identity(torch.ones(4))))
    p[-8:-4] = struct.pack("<f", float("nan"))
    p[-4:] = struct.pack("<I", zlib.crc32(bytes(p[:-4])) & 0xFFFFFFFF)
    with pytest.raises(PayloadError, match="NaN or Inf"):
        decode(bytes(p))


def test_identity_values_with_nan_refused_on_encode() -> None:
    import torch

    from dqsgd.codecs import encode
    from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme

    q = Quantized(Scheme.IDENTITY, 32, 1, torch.zeros(0, dtype=torch.int32), torch.zeros(0), Layout(), (2,),
                  Norm.NONE, torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode(q)


@SETTINGS
@given(q=identity_quantized(max_numel=40), resealed=st.booleans(), cut=st.integers(0, 3), data=st.data())
def test_mutated_raw_payloads(q: Quantized, resealed: bool, cut: int, data: st.DataObject) -> None:
    """The raw float32 schemes (IDENTITY and the count sketch's SKETCH table): mutated, cut or padded
    payloads are refused or decode to a payload that re-encodes to the same bytes."""
    _check_canonical(_mutated(encode(q, Coding.FIXED), resealed, cut, data))


def test_sketch_payload_refuses_other_widths_and_codings() -> None:
    table = torch.ones(6)
    q = Quantized(Scheme.SKETCH, 32, 1, torch.zeros(0, dtype=torch.int32), torch.zeros(0), Layout(), (2, 3),
                  Norm.NONE, table)
    assert decode(encode(q)).scheme == Scheme.SKETCH
    with pytest.raises(PayloadError, match="SKETCH needs bits = 32"):
        decode(forge(scheme=Scheme.SKETCH, bits=16, dims=(2,), scales=(), body=b"\x00" * 4))
    with pytest.raises(PayloadError, match="SKETCH payload with ELIAS"):
        decode(forge(scheme=Scheme.SKETCH, bits=32, coding=Coding.ELIAS, dims=(1,), scales=(), body=b"\x00" * 4))


def test_version_1_payload_reencodes_as_version_2() -> None:
    """Found by the raw-payload fuzz: a payload mutated into version 1 (with its crc fixed) decodes."""
    p = bytearray(encode(Quantized(Scheme.IDENTITY, 32, 1, torch.zeros(0, dtype=torch.int32), torch.zeros(0),
                                   Layout(), (3,), Norm.NONE, torch.ones(3))))
    p[2] = 1
    _check_canonical(reseal(p))
