"""Decode-accumulate of a payload this process entropy-coded adds the codes it kept: the same sum as
decoding, only for exactly the same bytes, within the bounds."""

import numpy as np
import pytest
import torch

from dqsgd.codecs import Coding, PayloadError, decode
from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast, recent
from dqsgd.quantizers import Layout, dequantize

RNG = HashRNG(3, 1, 4)


@pytest.fixture(autouse=True)
def _fresh() -> None:
    recent.clear()


@pytest.mark.parametrize("coding", [Coding.RANSX, Coding.RANS, Coding.ELIAS, Coding.AUTO])
def test_a_remembered_payload_adds_what_decoding_adds(coding: Coding) -> None:
    x = torch.randn(20_011, generator=torch.Generator().manual_seed(0)) * torch.rand(20_011) ** 3
    p = encode_uniform_fast(x, 5, RNG, layout=Layout(sizes=(11, 20_000)), coding=coding)
    if coding != Coding.AUTO:
        assert recent.recall(memoryview(p)) is not None
    kept, fresh = torch.zeros(20_011), torch.zeros(20_011)
    decode_accumulate(bytearray(p), kept, 0.25)  # another buffer, the same bytes
    recent.clear()
    decode_accumulate(p, fresh, 0.25)
    assert torch.equal(kept, fresh) and torch.equal(fresh, 0.25 * dequantize(decode(p)).reshape(-1))


def test_only_the_same_bytes_are_recalled() -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    p = encode_uniform_fast(x, 4, RNG, coding=Coding.RANSX)
    codes = recent.recall(memoryview(p))
    assert codes is not None and np.array_equal(codes, decode(p).codes.numpy())
    other = bytearray(p)
    other[40] ^= 1  # same length, same stored crc: compared in full, not recalled
    assert recent.recall(memoryview(other)) is None
    with pytest.raises(PayloadError, match="crc"):  # and decoded as any received payload: refused
        decode_accumulate(other, torch.zeros(5000))
    assert recent.recall(memoryview(p[:-1])) is None


def test_bounded_by_entries() -> None:
    xs = [torch.randn(300, generator=torch.Generator().manual_seed(s)) for s in range(recent.ENTRIES + 2)]
    ps = [encode_uniform_fast(x, 3, RNG, coding=Coding.RANS) for x in xs]
    assert recent.recall(memoryview(ps[0])) is None and recent.recall(memoryview(ps[1])) is None
    assert all(recent.recall(memoryview(p)) is not None for p in ps[2:])
