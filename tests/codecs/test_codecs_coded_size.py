"""``coded_size``: the length a payload's levels take with the best coding (AUTO), measured by encoding."""

from __future__ import annotations

import pytest
import torch
from codec_strategies import SETTINGS, identity_quantized, quantized
from hypothesis import given
from hypothesis import strategies as st

from dqsgd.codecs import Coding, PayloadError, coded_size, decode, encode
from dqsgd.quantizers import quantize_identity, quantize_sign, quantize_ternary, quantize_uniform
from dqsgd.quantizers.base import Quantized, Scheme

CHOSEN_FROM = [Coding.FIXED, Coding.ELIAS, Coding.ZSTD_ALIGNED, Coding.RANS, Coding.AUTO]


@SETTINGS
@given(q=quantized(), coding=st.sampled_from([*CHOSEN_FROM, Coding.ZSTD]))
def test_coded_size_is_the_length_of_the_auto_reencoding(q: Quantized, coding: Coding) -> None:
    payload = encode(q, coding)
    assert coded_size(payload) == len(encode(decode(payload), Coding.AUTO))


@SETTINGS
@given(q=quantized(), coding=st.sampled_from(CHOSEN_FROM))
def test_coded_size_never_exceeds_a_payload_whose_coding_auto_chooses_from(q: Quantized, coding: Coding) -> None:
    payload = encode(q, coding)
    assert coded_size(payload) <= len(payload)
    if coding == Coding.AUTO:  # already the smallest: re-encoding changes nothing
        assert coded_size(payload) == len(payload)


def _gaussian(n: int = 20_000, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme", ["uniform", "sign", "ternary"])
def test_fixed_payloads_of_the_quantizers_shrink_to_their_entropy(scheme: str) -> None:
    """FIXED payloads of real quantizer output: never larger, and strictly smaller where the levels
    are far from uniform (4-bit QSGD levels of a Gaussian, ternary with many zeros)."""
    g, gen = _gaussian(), torch.Generator().manual_seed(1)
    q = {"uniform": lambda: quantize_uniform(g, 4, gen), "sign": lambda: quantize_sign(g),
         "ternary": lambda: quantize_ternary(g, gen)}[scheme]()
    payload = encode(q, Coding.FIXED)
    size = coded_size(payload)
    assert size <= len(payload)
    if scheme == "sign":  # ±1 with probability 1/2 each: 1 bit per sign is already the entropy
        assert size == len(payload)
    else:
        assert size < 0.8 * len(payload), (scheme, size, len(payload))


@SETTINGS
@given(q=identity_quantized())
def test_identity_payloads_count_their_own_length(q: Quantized) -> None:
    payload = encode(q, Coding.FIXED)
    assert coded_size(payload) == len(payload)


def test_identity_keeps_its_length_even_when_zstd_would_shrink_it() -> None:
    payload = encode(quantize_identity(torch.zeros(10_000)), Coding.FIXED)
    assert len(encode(decode(payload), Coding.AUTO)) < len(payload) // 10  # zstd of zeros, not entropy coding
    assert coded_size(payload) == len(payload)


def test_malformed_payloads_and_the_element_cap_are_refused() -> None:
    payload = encode(quantize_uniform(_gaussian(1000), 4, torch.Generator().manual_seed(0)), Coding.FIXED)
    bad = bytearray(payload)
    bad[-10] ^= 0x01
    with pytest.raises(PayloadError, match="crc"):
        coded_size(bytes(bad))
    with pytest.raises(PayloadError):
        coded_size(payload, max_numel=999)
    assert coded_size(payload, max_numel=1000) == coded_size(payload)
    assert decode(payload).scheme == Scheme.UNIFORM
