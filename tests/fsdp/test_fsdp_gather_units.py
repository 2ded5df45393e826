"""The parameter all-gather's pieces in one process: options, payload bound and refusals."""

import pytest
import torch
from torch import nn

import dqsgd.fsdp as dfsdp
from dqsgd.codecs import PayloadError
from dqsgd.fsdp.gather import decode_shard, encode_shard, param_bound, payload_cap


@pytest.mark.parametrize("kw", [{"param_bits": 2}, {"param_bits": True}, {"param_rounding": "up"},
                                {"param_bits": 8, "param_block": 0}])
def test_bad_options_are_refused(kw) -> None:
    with pytest.raises(ValueError, match="param_"):
        dfsdp.FSDPState("sgd", **kw)


def test_gradients_false_needs_param_bits() -> None:
    with pytest.raises(ValueError, match="would change nothing"):
        dfsdp.compress(nn.Linear(2, 2), dfsdp.FSDPState("sgd"), gradients=False)


@pytest.mark.parametrize("bits", [4, 8, 32])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_round_trip_within_bound_and_cap(bits: int, rounding: str) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.01, 10, 1000)
    p = encode_shard(x, bits, rounding, 64, seed=7)
    assert len(p) == payload_cap(x.numel(), bits, 64)  # fixed coding: the size is the bound
    v = decode_shard(p, x.numel(), bits, 64)
    r = torch.nn.functional.pad(x, (0, 24)).view(-1, 64).abs().amax(1, keepdim=True).expand(-1, 64).reshape(-1)[:1000]
    assert bool(((v - x).abs() <= param_bound(r, bits, rounding) + 2.0 ** -20 * r).all())
    assert bits == 32 and torch.equal(v, x) or not torch.equal(v, x)


def test_a_payload_of_another_width_or_length_is_refused() -> None:
    x = torch.randn(100)
    with pytest.raises(PayloadError, match="expected UNIFORM of 100 at 8 bits"):
        decode_shard(encode_shard(x, 4, "nearest", 16, 0), 100, 8, 16)
    with pytest.raises(PayloadError):
        decode_shard(encode_shard(x[:99], 8, "nearest", 16, 0), 100, 8, 16)
    with pytest.raises(PayloadError, match="expected UNIFORM of 100 at 8 bits, blocks of 32"):
        decode_shard(encode_shard(x, 8, "nearest", 16, 0), 100, 8, 32)
