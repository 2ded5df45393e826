"""Format version 2: the payload records the input's dtype, and version 1 payloads still decode."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

import dqsgd
from dqsgd.codecs import Coding, PayloadError, decode, encode
from dqsgd.codecs.header import DTYPES, VERSION
from dqsgd.kernels import HashRNG, encode_uniform_fast
from dqsgd.quantizers import Layout, Norm, dequantize, quantize_uniform

# Payloads written by dqsgd before format version 2 (encode of linspace(-1, 1.5, 12).reshape(3, 4),
# torch.Generator seed 3, in this order), and the values decode gave for them then.
V1_FIXTURES = [
    ("445101010400ff0207000000030000000400000001050000000000803f74d1853f0000c03f06000000215497cafdfeaead48b8",
     [-1.0, -0.8571429252624512, -0.5714285969734192, -0.4285714626312256, -0.1428571492433548,
      0.14935064315795898, 0.29870128631591797, 0.5974025726318359, 0.7467532157897949, 1.045454502105713,
      1.2857142686843872, 1.5]),
    ("445101010301ff02030000000300000004000000000000c03f07000000ecc6312c0210c0b0a822c2",
     [-1.0, -1.0, -1.0, -0.5, -0.5, 0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.5]),
    ("445101010205ff02010000000300000004000000000000c03f13000000030180800100abd50100d5aa0116322403f6e7d29dd058",
     [-1.5, -1.5, -1.5, 0.0, 0.0, 0.0, 0.0, 0.0, 1.5, 1.5, 1.5, 1.5]),
    ("44510100200000020100000003000000040000000030000000000080bf74d145bfe8a20bbfbae8a2be882ebabdeba20b3e8a2eba3e"
     "d145173f5d74513f74d1853fbae8a23f0000c03f9d78f955",
     [-1.0, -0.7727272510528564, -0.5454545021057129, -0.3181818127632141, -0.09090906381607056,
      0.1363636702299118, 0.363636314868927, 0.5909090638160706, 0.8181818127632141, 1.045454502105713,
      1.2727272510528564, 1.5]),
    ("445101010504ff020f0000000300000004000000000000c03f1500000028b52ffd200c61000006080a0d0f111416181b1d1fd0404c07",
     [-1.0, -0.800000011920929, -0.6000000238418579, -0.30000001192092896, -0.10000000149011612,
      0.10000000149011612, 0.4000000059604645, 0.6000000238418579, 0.800000011920929, 1.100000023841858,
      1.3000000715255737, 1.5]),
]


def _reseal(unsigned: bytes) -> bytes:
    return unsigned + struct.pack("<I", zlib.crc32(unsigned))


@pytest.mark.parametrize(("hexpayload", "values"), V1_FIXTURES)
def test_version_1_payloads_decode_unchanged(hexpayload: str, values: list[float]) -> None:
    payload = bytes.fromhex(hexpayload)
    assert payload[2] == 1
    got = dqsgd.decode(payload)
    assert got.dtype == torch.float32 and got.shape == (3, 4)
    assert torch.equal(got.flatten(), torch.tensor(values, dtype=torch.float32))
    # the same message in version 2 differs only in the version byte (and so the crc)
    assert decode(payload).dtype == torch.float32
    assert encode(decode(payload), Coding(payload[5])) == _reseal(payload[:2] + bytes([VERSION]) + payload[3:-4])


def test_version_1_has_no_dtype_nibble() -> None:
    """In version 1 the whole byte 7 is ndim, so high bits there mean ndim > 8 (refused as before)."""
    payload = bytes.fromhex(V1_FIXTURES[0][0])
    forged = _reseal(payload[:7] + bytes([payload[7] | 1 << 4]) + payload[8:-4])
    with pytest.raises(PayloadError, match="ndim 18 at offset 7 exceeds"):
        decode(forged)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [
    {"bits": 4, "bucket": 5}, {"bits": 3, "coding": "elias"}, {"bits": 2, "coding": "rans"},
    {"scheme": "identity"}, {"scheme": "sign"}, {"scheme": "ternary"}, {"scheme": "lowprec", "bits": 8},
    {"bits": 5, "coding": "zstd-aligned"},
])
def test_decode_returns_the_input_dtype(dtype: torch.dtype, kw: dict) -> None:
    x = torch.linspace(-1, 1.5, 12, dtype=torch.float64).reshape(3, 4).to(dtype)
    payload = dqsgd.encode(x, generator=torch.Generator().manual_seed(5), **kw)
    q = decode(payload)
    assert q.dtype == dtype
    got = dqsgd.decode(payload)
    assert got.dtype == dtype and got.shape == x.shape
    # float32 arithmetic, then one rounding to the dtype: the float32 result rounded
    assert torch.equal(got, dequantize(decode(payload)).to(torch.float32).to(dtype))
    # the float32 encode of the same values has the same codes: payloads differ only in byte 7 and crc
    same32 = dqsgd.encode(x.to(torch.float32), generator=torch.Generator().manual_seed(5), **kw)
    assert payload[:7] == same32[:7] and payload[8:-4] == same32[8:-4]
    assert payload[7] == same32[7] | DTYPES.index(dtype) << 4


def test_unknown_dtype_code_and_unsupported_dtype_are_refused() -> None:
    payload = dqsgd.encode(torch.ones(4))
    forged = _reseal(payload[:7] + bytes([payload[7] | 7 << 4]) + payload[8:-4])
    with pytest.raises(PayloadError, match="unknown dtype code 7"):
        decode(forged)
    q = quantize_uniform(torch.ones(4), 4, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="carries dtypes float32, float16, bfloat16, float64, not torch.int8"):
        encode(q.__class__(**{**q.__dict__, "dtype": torch.int8}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("coding", [Coding.FIXED, Coding.ZSTD_ALIGNED, Coding.RANS, Coding.RANSX])
def test_fused_encoder_writes_the_same_dtype(dtype: torch.dtype, coding: Coding) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    rng = HashRNG(11, 3, 1)
    layout = Layout(bucket=128)
    fast = encode_uniform_fast(x, 4, rng, norm=Norm.MAX, layout=layout, coding=coding)
    assert fast == encode(quantize_uniform(x, 4, norm=Norm.MAX, layout=layout, rng=rng), coding)
    assert dqsgd.decode(fast).dtype == dtype
