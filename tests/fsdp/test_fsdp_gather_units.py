"""The parameter all-gather's pieces in one process: options, payload bound and refusals."""

import pytest
import torch
from torch import nn

import dqsgd.fsdp as dfsdp
from dqsgd.codecs import PayloadError
from dqsgd.fsdp.gather import HEADER, decode_shard, encode_shard, frame, opened, param_bound, payload_cap


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


def _open(frames: list[torch.Tensor], cap: int, n: int, bits: int = 8) -> torch.Tensor:
    out = torch.zeros(len(frames), n)
    opened(frames, cap, "rank 0: FSDP unit 2 parameter all-gather", 5,
           lambda w, p: decode_shard(p, n, bits, 16, out[w]))
    return out


def test_frames_have_one_size_and_open_to_the_decoded_payloads() -> None:
    """Every rank's frame is HEADER.size + cap bytes whatever it carries, and opening the W frames
    decodes exactly the W payloads: no sizes need to travel before them."""
    xs = [torch.randn(100, generator=torch.Generator().manual_seed(w)) for w in range(3)]
    cap = payload_cap(100, 8, 16)
    payloads = [encode_shard(x, 8, "nearest", 16, 0) for x in xs]
    frames = [frame(p, cap) for p in payloads]
    assert {f.numel() for f in frames} | {frame(b"", cap).numel()} == {HEADER.size + cap}
    got = _open(frames, cap, 100)
    for w, p in enumerate(payloads):
        assert torch.equal(got[w], decode_shard(p, 100, 8, 16))


def test_every_refusal_names_the_sender() -> None:
    """What each rank raises from the gathered frames alone (all ranks hold the same bytes, so all
    raise it): a length past the cap, an unknown status, non-finite shards, a payload the decode refuses."""
    x = torch.randn(100)
    cap = payload_cap(100, 8, 16)
    good = frame(encode_shard(x, 8, "nearest", 16, 0), cap)
    long = frame(encode_shard(x, 8, "nearest", 16, 0) + bytes(9), cap)
    assert long.numel() == good.numel()
    with pytest.raises(PayloadError, match=rf"^rank 0: FSDP unit 2 parameter all-gather: rank 1 announced a payload "
                                           rf"of {cap + 9} bytes; .* at most {cap} bytes here"):
        _open([good, long, good], cap, 100)
    odd = good.clone()
    odd[8] = 7
    with pytest.raises(PayloadError, match="rank 2 sent a frame of status 7"):
        _open([good, good, odd], cap, 100)
    with pytest.raises(ValueError, match=r"all-gather 5: the parameter shard of rank\(s\) \[0, 2\] holds NaN"):
        _open([frame(b"", cap), good, frame(b"", cap)], cap, 100)
    narrow = frame(encode_shard(x, 4, "nearest", 16, 0), cap)
    with pytest.raises(PayloadError, match="all-gather 5: every rank refuses the payload of rank 1: .*expected "
                                           "UNIFORM of 100 at 8 bits"):
        _open([good, narrow, good], cap, 100)
    flipped = good.clone()
    flipped[-6] ^= 0xFF
    with pytest.raises(PayloadError, match="every rank refuses the payload of rank 0"):
        _open([flipped, good], cap, 100)
