"""The quantizer registry: what each scheme declares, that its entry quantizes exactly as the scheme's
own function does, and that a new scheme needs only its entry and one registry line."""

from __future__ import annotations

import pytest
import torch
from bucket_ref import aggregate

import dqsgd
from dqsgd.codecs import Coding, encode as encode_payload
from dqsgd.kernels import HashRNG
from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method, ProtocolError
from dqsgd.quantizers import (
    QUANTIZERS, Layout, Norm, Quantized, Scheme, SchemeQuantizer, dequantize, levels_for_bits, quantize_identity,
    quantize_lowprec, quantize_sign, quantize_ternary, quantize_uniform, quantizer, registry,
)


def _gen(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_what_each_scheme_declares() -> None:
    assert list(QUANTIZERS) == ["identity", "uniform", "sign", "scaled-sign", "ternary", "lowprec", "sketch", "topk",
                                "randk"]
    assert all(q.name == name for name, q in QUANTIZERS.items())
    assert registry.method_schemes() == ("identity", "uniform", "sign", "ternary", "sketch", "topk", "randk")
    assert {n: q.nominal_bits(5) for n, q in QUANTIZERS.items()} == {
        "identity": 32, "uniform": 5, "sign": 1, "scaled-sign": 1, "ternary": 2, "lowprec": 5, "sketch": 32, "topk": 5,
        "randk": 5}
    assert {n for n, q in QUANTIZERS.items() if q.dynamic} == {"uniform", "lowprec", "topk", "randk"}
    assert {n for n, q in QUANTIZERS.items() if q.fused} == {"uniform"}
    assert {n for n, q in QUANTIZERS.items() if q.shares_scalers} == {"ternary"}
    assert {n for n, q in QUANTIZERS.items() if not q.segment_scales} == {"identity", "sketch"}
    assert [QUANTIZERS[n].scheme for n in ("identity", "uniform", "sign", "ternary", "lowprec", "sketch")] == [
        Scheme.IDENTITY, Scheme.UNIFORM, Scheme.SIGN, Scheme.TERNARY, Scheme.LOWPREC, Scheme.SKETCH]


def test_bits_a_method_may_configure() -> None:
    u, i = quantizer("uniform"), quantizer("identity")
    assert [b for b in range(0, 20) if u.bits_error(b) is None] == list(range(2, 17))
    assert "[2, 16]" in u.bits_error(17) and i.bits_error(32) is None and "must be 32" in i.bits_error(8)
    assert quantizer("sign").bits_error(7) is None  # fixed-width schemes send their own width whatever is set


def test_levels_for_bits_is_the_formula() -> None:
    assert [levels_for_bits(b) for b in range(1, 9)] == [1, 1, 3, 7, 15, 31, 63, 127]
    assert all(levels_for_bits(b) == 2 ** (b - 1) - 1 for b in range(2, 64))


def _same(a: Quantized, b: Quantized) -> None:
    assert encode_payload(a, Coding.FIXED) == encode_payload(b, Coding.FIXED)


@pytest.mark.parametrize("layout", [Layout(), Layout(bucket=64), Layout(sizes=(100, 57, 100))])
def test_each_entry_quantizes_as_its_function(layout: Layout) -> None:
    x = torch.randn(257, generator=_gen(1))
    _same(quantizer("uniform").quantize(x, 5, _gen(), layout=layout, norm=Norm.L2),
          quantize_uniform(x, 5, _gen(), norm=Norm.L2, layout=layout))
    _same(quantizer("sign").quantize(x, 1, layout=layout), quantize_sign(x, layout=layout))
    _same(quantizer("sign").quantize(x, 1, layout=layout, scaled=True), quantize_sign(x, scaled=True, layout=layout))
    _same(quantizer("scaled-sign").quantize(x, 1, layout=layout), quantize_sign(x, scaled=True, layout=layout))
    _same(quantizer("ternary").quantize(x, 2, _gen(), layout=layout),
          quantize_ternary(x, _gen(), layout=layout))  # clip None: TernGrad's 2.5
    _same(quantizer("ternary").quantize(x, 2, _gen(), layout=layout, clip=0.0),
          quantize_ternary(x, _gen(), layout=layout, clip=0.0))
    shared = quantizer("ternary").scalers(x, layout=layout, clip=1.5) * 1.25
    _same(quantizer("ternary").quantize(x, 2, _gen(), layout=layout, scalers=shared),
          quantize_ternary(x, _gen(), layout=layout, scalers=shared))
    _same(quantizer("lowprec").quantize(x, 6, _gen()), quantize_lowprec(x, 6, _gen()))
    _same(quantizer("identity").quantize(x, 32), quantize_identity(x))


def test_unknown_schemes_and_scalers_are_clear_errors() -> None:
    known = "identity, uniform, sign, scaled-sign, ternary, lowprec, sketch, topk or randk"
    with pytest.raises(ValueError, match=f"unknown scheme 'fp8'; use {known}"):
        quantizer("fp8")
    allowed = r"\('identity', 'uniform', 'sign', 'ternary', 'sketch', 'topk', 'randk'\)"
    with pytest.raises(ValueError, match=rf"scheme must be one of {allowed}, got 'lowprec'"):
        method_config("qsgd", scheme="lowprec")
    with pytest.raises(ValueError, match="policy 'dqsgd-budget' needs the uniform scheme"):
        method_config("dqsgd", scheme="sign", bits=1)
    with pytest.raises(ValueError, match="shares no scalers"):
        quantizer("sign").scalers(torch.ones(3))
    with pytest.raises(ValueError, match="unknown scheme"):
        dqsgd.encode(torch.ones(3), scheme="fp8", rng=HashRNG(0, 0, 0))


class _Nearest(SchemeQuantizer):
    """A scheme the package does not have: deterministic round-to-nearest on the uniform grid."""

    name, scheme = "nearest", Scheme.UNIFORM

    def quantize(self, x, bits, generator=None, *, layout=Layout(), norm=Norm.MAX, scaled=False, scalers=None,
                 clip=None) -> Quantized:
        s, r = levels_for_bits(bits), x.abs().amax().reshape(1)
        codes = torch.round(x / r * s).to(torch.int32)
        return Quantized(Scheme.UNIFORM, bits, s, codes, r, Layout(), tuple(x.shape), Norm.MAX)


def test_a_new_scheme_is_one_entry_and_one_registry_line(monkeypatch) -> None:
    monkeypatch.setitem(registry.QUANTIZERS, "nearest", _Nearest())  # the one line
    assert registry.method_schemes()[-1] == "nearest"
    cfg = method_config("qsgd", scheme="nearest", bits=3)
    m = Method(cfg, 50, 10)
    assert cfg.nominal_bits() == 3 and m.width(9) == 3 and not m.fused and not m.shares_scalers
    gs = [torch.randn(50, generator=_gen(w)) for w in range(3)]
    msgs = [m.encode(g, 3, None)[0] for g in gs]
    assert all(len(p) == m.max_payload_bytes(3) == m.message_bits(3) // 8 for p in msgs)
    weight = torch.tensor(1.0 / 3, dtype=torch.float32)  # each payload scaled before the sum
    want = sum(weight * dequantize(_Nearest().quantize(g, 3)) for g in gs)
    assert torch.equal(aggregate(m, msgs, 3), want)
    with pytest.raises(ProtocolError, match="expected a UNIFORM message of 50 values at 3 bits"):
        aggregate(m, [dqsgd.encode(gs[0], bits=4, generator=_gen())], 3)
    with pytest.raises(ValueError, match="policy 'adaptive' needs the uniform scheme"):
        method_config("adaptive", scheme="nearest")
