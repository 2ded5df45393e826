"""The device codec (torch ops on the tensor's device) writes the numba kernel's payload byte for byte,
decodes it bit for bit, refuses what the host refuses, and stays unbiased."""

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dqsgd.codecs import Coding, PayloadError, decode, encode
from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast
from dqsgd.kernels.device import (
    decode_accumulate_device, decode_device, encode_uniform_device, expected_header,
)
from dqsgd.kernels.device_crc import crc32_device
from dqsgd.kernels.fused import CHUNK
from dqsgd.quantizers import Layout, NonFiniteGradientError, Norm, dequantize, quantize_sign, quantize_ternary

RNG = HashRNG(11, 5, 3)


def layouts(n: int) -> list[Layout]:
    return [Layout(), Layout(bucket=100), Layout(bucket=CHUNK + 3), Layout(sizes=(n // 3, 0, n - n // 3))]


def host(p: torch.Tensor) -> bytes:
    return bytes(p.cpu().numpy())


@pytest.mark.parametrize("bits", range(1, 17))
def test_device_payload_is_the_fused_payload_at_every_width(bits: int) -> None:
    for n in (0, 1, 7, 10_007):
        x = torch.randn(n, generator=torch.Generator().manual_seed(bits + n))
        for layout in layouts(n):
            for norm in (Norm.MAX, Norm.L2):
                p = encode_uniform_device(x, bits, RNG, norm=norm, layout=layout)
                assert p.dtype == torch.uint8 and p.device == x.device
                assert host(p) == encode_uniform_fast(x, bits, RNG, norm=norm, layout=layout, coding=Coding.FIXED)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), bits=st.integers(1, 16), bucket=st.integers(0, 700), seed=st.integers(0, 2**40),
       scale=st.sampled_from([0.0, 1e-30, 1.0, 3e4]), shape2=st.booleans())
def test_device_payload_sweep(n: int, bits: int, bucket: int, seed: int, scale: float, shape2: bool) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed % 1000)) * scale
    if shape2 and n % 2 == 0:
        x = x.view(2, n // 2)
    rng = HashRNG(seed, seed % 7, 2)
    layout = Layout(bucket=bucket)
    p = encode_uniform_device(x, bits, rng, layout=layout)
    assert host(p) == encode_uniform_fast(x, bits, rng, layout=layout)
    out, ref = torch.randn(n), torch.randn(n)
    ref_copy = ref.clone()
    out.copy_(ref)
    decode_accumulate_device(p, out, 0.625)
    decode_accumulate(host(p), ref_copy, 0.625)
    assert torch.equal(out, ref_copy)


def test_crc_equals_zlib_on_random_lengths() -> None:
    gen = np.random.default_rng(0)
    lengths = [0, 1, 2, 3, 4, 5, 8, 63, 64, 65, 1023, 4097] + gen.integers(0, 100_001, 20).tolist()
    for n in lengths:
        data = gen.integers(0, 256, n, dtype=np.uint8)
        assert int(crc32_device(torch.from_numpy(data))) == zlib.crc32(data.tobytes()), n
    assert int(crc32_device(torch.zeros(100_000, dtype=torch.uint8))) == zlib.crc32(bytes(100_000))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8, 11, 16])
def test_decode_is_bit_identical_to_the_host(bits: int) -> None:
    n = 10_007
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits))
    for layout in layouts(n):
        for norm in (Norm.MAX, Norm.L2):
            p = encode_uniform_device(x, bits, RNG, norm=norm, layout=layout)
            ref = dequantize(decode(host(p))).reshape(-1)
            assert torch.equal(decode_device(p).reshape(-1), ref)
            start = torch.randn(n, generator=torch.Generator().manual_seed(7))
            for header in (None, expected_header((n,), bits, norm=norm, layout=layout)):
                for w in (1.0, -0.3):
                    out, want = start.clone(), start.clone()
                    decode_accumulate_device(p, out, w, header=header)
                    decode_accumulate(host(p), want, w)
                    assert torch.equal(out, want)
            assert torch.equal(start + ref, _acc(p, start))


def _acc(p: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    out = start.clone()
    decode_accumulate_device(p, out)
    return out


def test_other_schemes_and_codings_decode_like_the_host() -> None:
    x = torch.randn(5001, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(1)
    payloads = [encode(quantize_sign(x)), encode(quantize_ternary(x, gen)),
                encode(quantize_sign(x, scaled=True, layout=Layout(sizes=(1000, 4001)))),
                encode_uniform_fast(x, 4, RNG, coding=Coding.ZSTD), encode_uniform_fast(x, 5, RNG, coding=Coding.ELIAS)]
    for b in payloads:
        p = torch.frombuffer(bytearray(b), dtype=torch.uint8)
        out, want = torch.ones(5001), torch.ones(5001)
        decode_accumulate_device(p, out, 0.5)
        decode_accumulate(b, want, 0.5)
        assert torch.equal(out, want)


# ------------------------------------------------------------------------------------- refusals


def _payload(bits: int = 4, n: int = 1001) -> tuple[torch.Tensor, Layout]:
    layout = Layout(bucket=300)
    return encode_uniform_device(torch.randn(n, generator=torch.Generator().manual_seed(0)), bits, RNG,
                                 layout=layout), layout


def _reseal(b: bytearray) -> torch.Tensor:
    b[-4:] = zlib.crc32(bytes(b[:-4])).to_bytes(4, "little")
    return torch.frombuffer(b, dtype=torch.uint8)


def test_refusals_match_the_host() -> None:
    p, layout = _payload()
    n, hdr = 1001, expected_header((1001,), 4, layout=layout)
    body_at, out = hdr.body_start, torch.zeros(1001)
    flipped = bytearray(host(p))
    flipped[body_at + 10] ^= 0x10
    bad_code = bytearray(host(p))
    bad_code[body_at] = (bad_code[body_at] & 0xF0) | 0x0  # offset value 0: code −8 < −levels = −7
    padded = bytearray(host(p))
    padded[-5] |= 0x80  # n·4 bits end mid-byte: the high nibble of the last body byte is padding
    forged = bytearray(host(p))
    forged[12:16] = (10**9).to_bytes(4, "little")  # dims: a huge numel
    cases = {"crc mismatch": torch.frombuffer(flipped, dtype=torch.uint8), "codes span": _reseal(bad_code),
             "padding": _reseal(padded), "truncated": p[:-1].clone(), "max_numel": _reseal(forged)}
    for msg, bad in cases.items():
        with pytest.raises(PayloadError, match=msg):
            decode_accumulate(host(bad), np.zeros(n, np.float32))
        with pytest.raises(PayloadError, match=msg):
            decode_accumulate_device(bad, out)
        assert not out.any()  # nothing was added
    for msg, bad in list(cases.items())[:3]:
        with pytest.raises(PayloadError, match=msg):
            decode_accumulate_device(bad, out, header=hdr)
        flag = torch.zeros((), dtype=torch.bool)
        decode_accumulate_device(bad, torch.zeros(n), header=hdr, check="defer", bad=flag)
        assert bool(flag), msg
    flag = torch.zeros((), dtype=torch.bool)
    decode_accumulate_device(p, torch.zeros(n), header=hdr, check="defer", bad=flag)
    assert not bool(flag)
    with pytest.raises(PayloadError, match="bytes"):
        decode_accumulate_device(p[:-1].clone(), out, header=hdr)
    other = encode_uniform_device(torch.randn(1001), 4, RNG, layout=Layout(bucket=301))
    assert other.numel() == p.numel()  # same length, another bucket size in the header
    with pytest.raises(PayloadError, match="differs"):
        decode_accumulate_device(other, out, header=hdr)


def test_bad_arguments_are_refused() -> None:
    p, _ = _payload()
    with pytest.raises(ValueError, match="out must be"):
        decode_accumulate_device(p, torch.zeros(1001, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be"):
        decode_accumulate_device(p, torch.zeros(1000))
    with pytest.raises(ValueError, match="1-D uint8"):
        decode_accumulate_device(p.to(torch.int32), torch.zeros(1001))
    with pytest.raises(ValueError, match="bad="):
        decode_accumulate_device(p, torch.zeros(1001), check="defer")
    with pytest.raises(ValueError, match="check"):
        encode_uniform_device(torch.randn(3), 4, RNG, check="later")
    with pytest.raises(ValueError, match="bits"):
        encode_uniform_device(torch.randn(3), 17, RNG)
    with pytest.raises(ValueError, match="norm"):
        encode_uniform_device(torch.randn(3), 4, RNG, norm=Norm.L1_MEAN)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
@pytest.mark.parametrize("norm", [Norm.MAX, Norm.L2])
def test_non_finite_input_is_refused_or_poisons_the_payload(bad_value: float, norm: Norm) -> None:
    x = torch.randn(500)
    x[123] = bad_value
    with pytest.raises(NonFiniteGradientError):
        encode_uniform_fast(x, 4, RNG, norm=norm)
    with pytest.raises(NonFiniteGradientError):
        encode_uniform_device(x, 4, RNG, norm=norm)
    p = encode_uniform_device(x, 4, RNG, norm=norm, check="defer")
    with pytest.raises(PayloadError, match="non-finite scale"):
        decode(host(p))
    with pytest.raises(PayloadError, match="non-finite scale"):
        decode_accumulate_device(p, torch.zeros(500))
    flag = torch.zeros((), dtype=torch.bool)
    decode_accumulate_device(p, torch.zeros(500), header=expected_header((500,), 4, norm=norm), check="defer",
                             bad=flag)
    assert bool(flag)


def test_too_small_norm_is_refused_like_the_host() -> None:
    x = torch.zeros(10)
    x[3] = 1e-45  # a subnormal: s / r overflows float32
    with pytest.raises(ValueError, match="too small"):
        encode_uniform_fast(x, 8, RNG)
    with pytest.raises(ValueError, match="too small"):
        encode_uniform_device(x, 8, RNG)
    with pytest.raises(PayloadError):
        decode(host(encode_uniform_device(x, 8, RNG, check="defer")))


# ------------------------------------------------------------------------------- unbiasedness


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("norm", [Norm.MAX, Norm.L2])
def test_device_decode_is_unbiased(bits: int, norm: Norm) -> None:
    """T copies of one 64-vector, one bucket each: same scale r, independent hash uniforms.

    Per coordinate, Var ≤ step²/4 (B ≥ 2, step = r/s: a Bernoulli times step) or ≤ r² (1 bit),
    and the bias is at most 2^-17·step (2^-16·r at 1 bit) with 16-bit uniforms. So the mean of T
    draws is within 6 standard errors plus the bias bound, except with probability < 1e-8 per
    coordinate (normal tail; T = 4000)."""
    d, t = 64, 4000
    v = torch.randn(d, generator=torch.Generator().manual_seed(bits))
    x = v.repeat(t)
    mean = decode_device(encode_uniform_device(x, bits, HashRNG(5, bits, 1), norm=norm,
                                               layout=Layout(bucket=d))).view(t, d).mean(0, dtype=torch.float64)
    r = float(v.abs().max() if norm == Norm.MAX else v.norm())
    step = r if bits == 1 else r / ((1 << (bits - 1)) - 1)
    sd = (r if bits == 1 else step / 2) / t**0.5
    bias = 2**-16 * r if bits == 1 else 2**-17 * step
    err = (mean - v.double()).abs()
    assert float(err.max()) <= 6 * sd + bias + 1e-6 * r, (float(err.max()), sd)
    assert float(err.max()) > 0  # it is random: a zero error would mean the draws are not


# ------------------------------------------------------------------------------------ devices


def test_outputs_stay_on_the_input_device() -> None:
    x = torch.randn(100)
    p = encode_uniform_device(x, 3, RNG)
    assert p.device == x.device
    assert decode_device(p).device == p.device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_payload_and_decode_equal_the_cpu() -> None:  # pragma: no cover - no GPU in CI
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(0))
    for bits in (1, 4, 8, 13):
        p = encode_uniform_device(x.cuda(), bits, RNG, layout=Layout(bucket=4096))
        assert p.device.type == "cuda"
        assert host(p) == encode_uniform_fast(x, bits, RNG, layout=Layout(bucket=4096))
        out = torch.zeros(100_003, device="cuda")
        decode_accumulate_device(p, out)
        assert torch.equal(out.cpu(), dequantize(decode(host(p))).reshape(-1))


def test_bench_device_rows_measure_the_real_payload() -> None:
    from dqsgd.cli.bench.common import device_codec_rows, pick_device
    from dqsgd.codecs.bitpack import packed_size

    (row,) = device_codec_rows(4099, [4], 1, pick_device("cpu"))
    assert row["path"] == "device-cpu" and row["payload_bytes"] == expected_header((4099,), 4).body_start + packed_size(
        4099, 4) + 4
    assert all(row[k] > 0 for k in ("enc_vs_copy", "dec_vs_copy", "encdec_vs_copy"))
    assert row["encdec_vs_copy"] < min(row["enc_vs_copy"], row["dec_vs_copy"])  # enc + dec takes longer than either
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA"):
            pick_device("cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_device_payload_records_the_dtype_like_the_host(dtype: torch.dtype) -> None:
    """Version-2 payloads carry the input dtype: the device encoder writes the host's bytes, and
    the device decoder restores that dtype with the host decoder's values."""
    import dqsgd
    from dqsgd.kernels import HashRNG, encode_uniform_fast
    from dqsgd.kernels.device import decode_device, encode_uniform_device

    x = torch.randn(1001).to(dtype)
    host = encode_uniform_fast(x, 4, HashRNG(1, 2, 3))
    dev = encode_uniform_device(x, 4, HashRNG(1, 2, 3))
    assert bytes(dev.numpy()) == host
    got, want = decode_device(dev), dqsgd.decode(host)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
