"""The parameter all-gather's fused codec (``encode_shard``/``decode_shard`` over
:mod:`dqsgd.kernels.rounding` and ``FixedPlan``) against the torch-ops path it replaced, bitwise, and
its refusals of damaged payloads."""

import struct
import zlib

import numpy as np
import pytest
import torch

from dqsgd.codecs import Coding, PayloadError, decode, encode
from dqsgd.fsdp.gather import decode_shard, encode_shard
from dqsgd.kernels.rounding import NEAREST, encode_rounded
from dqsgd.quantizers import Layout, NonFiniteGradientError, dequantize, quantize_uniform


class _Half:
    def uniform(self, n: int, device=None) -> torch.Tensor:
        return torch.full((n,), 0.5, dtype=torch.float32, device=device)


def torch_ops(x: torch.Tensor, bits: int, rounding: str, block: int, seed: int) -> bytes:
    """The payload the all-gather sent before the fused kernel: quantize_uniform, then the codec."""
    layout = Layout(bucket=block)
    if rounding == "nearest":
        return encode(quantize_uniform(x, bits, layout=layout, rng=_Half()), Coding.FIXED)
    return encode(quantize_uniform(x, bits, torch.Generator().manual_seed(seed), layout=layout), Coding.FIXED)


def shard(n: int, seed: int) -> torch.Tensor:
    """Parameters of mixed magnitudes, with a run of zeros (a zero block at small blocks), a −0.0,
    values exactly on levels and on half-levels (the round-to-nearest ties)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(3) * 10
    if n >= 64:
        x[8:40] = 0.0
        x[41] = -0.0
        x[42:46] = torch.tensor([1.0, -0.5, 0.25, 1.0 / 7 * 3.5])  # a block's max, and ties at 4 bits (s = 7)
    return x


SIZES = [0, 1, 7, 9, 100, 4095, 4097, 9000, 262400]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_fused_payload_is_the_torch_ops_payload(n: int, bits: int, rounding: str) -> None:
    for block in (1, 16, 2048, 5000):
        x = shard(n, n + bits + block)
        assert encode_shard(x, bits, rounding, block, 11) == torch_ops(x, bits, rounding, block, 11), block


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 7, 9, 12, 16])
def test_other_widths_give_the_torch_ops_payload(bits: int) -> None:
    x = shard(9000, bits)
    for block in (3, 64, 4096):
        assert encode_rounded(x, bits, Layout(bucket=block)) == torch_ops(x, bits, "nearest", block, 0)
        u = torch.rand(9000, generator=torch.Generator().manual_seed(bits))
        assert encode_rounded(x, bits, Layout(bucket=block), u.numpy()) == torch_ops(x, bits, "stochastic", block,
                                                                                      bits)


def test_threads_do_not_change_the_payload() -> None:
    x = shard(1 << 20, 3)  # 256 chunks: run_split uses every thread it is given
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = encode_shard(x, 4, "nearest", 2048, 0)
        torch.set_num_threads(3)
        assert encode_shard(x, 4, "nearest", 2048, 0) == one
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_is_dequantize_bitwise(bits: int) -> None:
    for n, block in ((262400, 2048), (9000, 16), (1, 2048), (0, 16)):
        x = shard(n, bits)
        p = encode_shard(x, bits, "nearest", block, 0)
        want = dequantize(decode(p)).reshape(-1)
        out = torch.zeros(n)
        got = decode_shard(p, n, bits, block, out)
        assert got is out and torch.equal(out, want)


def test_non_finite_parameters_give_an_empty_payload() -> None:
    for bad in (float("nan"), float("inf")):
        x = shard(5000, 1)
        x[4321] = bad
        for bits in (4, 8, 32):
            assert encode_shard(x, bits, "nearest", 2048, 0) == b""
        with pytest.raises(NonFiniteGradientError):
            encode_rounded(x, 8, Layout(bucket=2048), NEAREST)


def _reseal(b: bytearray) -> bytes:
    """The payload with its crc recomputed (a forger who knows the format)."""
    b[-4:] = struct.pack("<I", zlib.crc32(bytes(b[:-4])))
    return bytes(b)


def _forgeries(p: bytes, n: int, bits: int) -> dict[str, bytes]:
    body_len = -(-n * bits // 8)
    head = len(p) - 4 - body_len
    scales = head - 4 - 4 * -(-n // 16)
    out = {}
    b = bytearray(p)
    b[head + 3] ^= 0x10
    out["flipped body bit"] = bytes(b)
    b = bytearray(p)
    b[head + 3] = 0  # offset binary 0: code −2^(b−1), beyond the s = 2^(b−1) − 1 levels
    out["code out of range"] = _reseal(b)
    b = bytearray(p)
    b[scales : scales + 4] = struct.pack("<f", float("inf"))
    out["infinite scale"] = _reseal(b)
    if bits == 8:  # 127 · fl(max/127) rounds past float32's max (at 4 bits 7 · fl(max/7) does not)
        b = bytearray(p)
        b[scales : scales + 4] = struct.pack("<f", float(np.finfo(np.float32).max))
        out["finite scale whose values overflow"] = _reseal(b)
    if (n * bits) % 8:
        b = bytearray(p)
        b[-5] |= 0x80
        out["padding bits"] = _reseal(b)
    out["truncated"] = p[:-1]
    out["padded"] = p + b"\0"
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_damaged_payloads_are_refused_like_the_codec_refuses_them(bits: int) -> None:
    n = 1001
    p = encode_shard(shard(n, 5), bits, "nearest", 16, 0)
    for name, bad in _forgeries(p, n, bits).items():
        with pytest.raises((PayloadError, ValueError)):  # the codec's own verdict on it
            dequantize(decode(bad))
        with pytest.raises(PayloadError):
            decode_shard(bad, n, bits, 16, torch.zeros(n))
        assert name
    assert len(_forgeries(p, n, bits)) == 6  # 8 bits: the overflowing scale; 4: 1001 codes leave padding bits


def test_a_foreign_header_gets_the_codec_s_message() -> None:
    x = shard(100, 2)
    with pytest.raises(PayloadError, match="expected UNIFORM of 100 at 8 bits"):
        decode_shard(encode_shard(x, 4, "nearest", 16, 0), 100, 8, 16)
    with pytest.raises(PayloadError, match="blocks of 32"):
        decode_shard(encode_shard(x, 8, "nearest", 16, 0), 100, 8, 32)
    with pytest.raises(PayloadError, match="not a dqsgd payload"):
        decode_shard(b"XY" + encode_shard(x, 8, "nearest", 16, 0)[2:], 100, 8, 16)


def test_bad_uniforms_are_refused() -> None:
    x = shard(100, 2)
    with pytest.raises(ValueError, match="uniforms"):
        encode_rounded(x, 8, Layout(bucket=16), np.full(99, 0.5, dtype=np.float32))
    with pytest.raises(ValueError, match="uniforms"):
        encode_rounded(x, 8, Layout(bucket=16), np.full(1, 0.5))
    with pytest.raises(ValueError, match="bits"):
        encode_rounded(x, 1, Layout(bucket=16))
