"""The top-level convenience API ``dqsgd.encode`` / ``dqsgd.decode``."""

import pytest
import torch

import dqsgd
from dqsgd.codecs import PayloadError


@pytest.mark.parametrize("coding", ["fixed", "elias", "zstd", "zstd-aligned", "zstd_aligned", "auto"])
@pytest.mark.parametrize("bits", [2, 4, 6])
def test_every_coding_name_round_trips_the_same_levels(coding: str, bits: int) -> None:
    g = torch.randn(3000)
    ref = dqsgd.decode(dqsgd.encode(g, bits=bits, generator=torch.Generator().manual_seed(1)))
    out = dqsgd.decode(dqsgd.encode(g, bits=bits, coding=coding, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(out, ref)  # the coding changes the bytes, never the quantized values
    s = 2 ** (bits - 1) - 1
    assert float((out - g).abs().max()) <= float(g.abs().max()) / s + 1e-6  # one level at most


@pytest.mark.parametrize("scheme", ["uniform", "sign", "scaled-sign", "ternary", "lowprec", "identity"])
def test_every_scheme_round_trips(scheme: str) -> None:
    g = torch.randn(257)
    out = dqsgd.decode(dqsgd.encode(g, scheme=scheme, bits=8, generator=torch.Generator().manual_seed(0)))
    assert out.shape == g.shape and torch.isfinite(out).all()
    if scheme == "identity":
        assert torch.equal(out, g)


def test_bad_arguments_and_payloads_are_clear_errors() -> None:
    g = torch.randn(10)
    with pytest.raises(ValueError, match="unknown coding 'gzip'.*zstd-aligned"):
        dqsgd.encode(g, coding="gzip")
    with pytest.raises(ValueError, match="unknown scheme 'fp8'"):
        dqsgd.encode(g, scheme="fp8")
    with pytest.raises(ValueError, match="unknown norm"):
        dqsgd.encode(g, norm="1")
    payload = dqsgd.encode(g)
    with pytest.raises(PayloadError):
        dqsgd.decode(payload[:-1])
