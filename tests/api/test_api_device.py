"""The device form of the public API: payload tensors, decode(device=...), decode_into, rng=."""

from __future__ import annotations

import types

import pytest
import torch

import dqsgd
from dqsgd import api
from dqsgd.codecs import Coding, PayloadError, encode as encode_q
from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast
from dqsgd.quantizers import Layout, Norm, quantize_uniform

CODINGS = ["fixed", "elias", "zstd", "zstd-aligned", "rans", "ransx", "auto"]


def _x(n: int = 1000, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(7)).to(dtype)


@pytest.mark.parametrize("coding", CODINGS)
def test_payload_tensor_holds_the_same_bytes(coding: str) -> None:
    x = _x().reshape(20, 50)
    payload = dqsgd.encode(x, coding=coding, generator=torch.Generator().manual_seed(1))
    t = dqsgd.encode_tensor(x, coding=coding, generator=torch.Generator().manual_seed(1))
    assert t.dtype == torch.uint8 and t.dim() == 1 and t.device == x.device
    assert t.numpy().tobytes() == payload
    got = dqsgd.decode(t)
    assert got.device.type == "cpu" and torch.equal(got, dqsgd.decode(payload))
    assert torch.equal(dqsgd.decode(payload, device="cpu"), got)


def test_rng_is_the_fused_hash_quantizer() -> None:
    x = _x(5000)
    rng = HashRNG(3, 4, 1)
    for coding in ("fixed", "zstd", "rans"):
        payload = dqsgd.encode(x, bits=3, bucket=512, coding=coding, rng=rng)
        layout = Layout(bucket=512)
        assert payload == encode_uniform_fast(x, 3, rng, norm=Norm.MAX, layout=layout, coding=Coding.from_name(coding))
        assert payload == encode_q(quantize_uniform(x, 3, norm=Norm.MAX, layout=layout, rng=rng),
                                   Coding.from_name(coding))
    with pytest.raises(ValueError, match="scheme='uniform' and without generator"):
        dqsgd.encode(x, scheme="sign", rng=rng)
    with pytest.raises(ValueError, match="without generator"):
        dqsgd.encode(x, rng=rng, generator=torch.Generator())


@pytest.mark.parametrize("coding", CODINGS)
def test_decode_into_float32_is_the_exact_sum(coding: str) -> None:
    x = _x()
    payload = dqsgd.encode(x, bits=5, bucket=128, coding=coding, generator=torch.Generator().manual_seed(2))
    base = _x(1000) * 3
    out = base.clone()
    assert dqsgd.decode_into(payload, out) is out
    assert torch.equal(out, base + dqsgd.decode(payload))
    out = base.clone().reshape(10, 100)  # any shape with the payload's element count
    dqsgd.decode_into(dqsgd.encode_tensor(x, bits=5, coding=coding, generator=torch.Generator()), out, weight=0.25)
    assert torch.isfinite(out).all()


def test_decode_into_weight_and_other_dtypes_and_layouts() -> None:
    x = _x()
    payload = dqsgd.encode(x, bits=4, generator=torch.Generator().manual_seed(3))
    xhat = dqsgd.decode(payload)
    out = torch.zeros(1000)
    dqsgd.decode_into(payload, out, weight=0.5)
    assert torch.equal(out, ref := torch.zeros(1000).add_(0.5 * xhat))  # w·x̂ in float32, one rounding
    half = torch.ones(1000, dtype=torch.float16)
    dqsgd.decode_into(payload, half, weight=0.5)
    assert half.dtype == torch.float16 and torch.equal(half, torch.ones(1000, dtype=torch.float16) + ref.half())
    strided = torch.zeros(2000)[::2]
    dqsgd.decode_into(payload, strided)
    assert torch.equal(strided, xhat)


def test_decode_into_refuses_other_sizes_and_non_float_outputs() -> None:
    payload = dqsgd.encode(_x())
    out = torch.zeros(999)
    with pytest.raises(PayloadError, match="declares 1000 elements .* expects numel=999"):
        dqsgd.decode_into(payload, out)
    assert not out.any()
    with pytest.raises(ValueError, match="floating-point"):
        dqsgd.decode_into(payload, torch.zeros(1000, dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D uint8"):
        dqsgd.decode(torch.zeros(10, dtype=torch.int32))


def test_decode_restores_dtype_through_tensor_payloads() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        t = dqsgd.encode_tensor(_x(64, dtype), generator=torch.Generator().manual_seed(0))
        assert dqsgd.decode(t).dtype == dtype


def test_device_kernels_absent_or_complete() -> None:
    """CPU tensors always take the host codec; elsewhere the device module is used when installed."""
    assert api._device_kernels(torch.device("cpu")) is None
    mod = api._device_kernels(torch.device("cuda"))
    assert mod is None or (hasattr(mod, "encode_uniform_device") and hasattr(mod, "decode_accumulate_device"))


def _fake_device_module(calls: list[str]) -> types.ModuleType:
    """The contract of ``dqsgd.kernels.device``, implemented with the host codec (CPU tensors)."""

    def encode_uniform_device(x, bits, rng, *, norm, layout):
        calls.append("encode")
        payload = encode_uniform_fast(x, bits, rng, norm=norm, layout=layout)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(x.device)

    def decode_accumulate_device(payload, out, weight=1.0, *, max_numel):
        calls.append(f"decode {max_numel}")
        assert payload.dtype == torch.uint8 and payload.device == out.device
        return decode_accumulate(payload.numpy().tobytes(), out, weight, max_numel=max_numel)

    mod = types.ModuleType("dqsgd.kernels.device")
    mod.encode_uniform_device = encode_uniform_device
    mod.decode_accumulate_device = decode_accumulate_device
    return mod


def test_device_module_is_called_with_its_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(api, "_device_kernels", lambda device: _fake_device_module(calls))
    x = _x(3000).reshape(30, 100)
    rng = HashRNG(1, 2, 3)
    t = dqsgd.encode_tensor(x, bits=4, bucket=256, rng=rng)
    assert calls == ["encode"]
    assert t.numpy().tobytes() == encode_uniform_fast(x, 4, rng, layout=Layout(bucket=256))
    assert dqsgd.encode(x, bits=4, rng=rng, coding="elias") == encode_uniform_fast(x, 4, rng, coding=Coding.ELIAS)
    assert calls == ["encode"]  # entropy codings are host work
    got = dqsgd.decode(t)
    assert calls[-1] == "decode 3000" and got.shape == (30, 100)
    monkeypatch.setattr(api, "_device_kernels", lambda device: None)
    assert torch.equal(got, dqsgd.decode(t))
    monkeypatch.setattr(api, "_device_kernels", lambda device: _fake_device_module(calls))
    out = torch.ones(3000)
    dqsgd.decode_into(t, out, weight=2.0)
    assert calls[-1] == "decode 3000" and torch.equal(out, torch.ones(3000).add_(2.0 * got.reshape(-1)))
    n = len(calls)
    with pytest.raises(PayloadError, match="expects numel=5"):
        dqsgd.decode(t, numel=5)  # sized from the header prefix: refused before the device decode
    with pytest.raises(PayloadError, match="max_numel=100"):
        dqsgd.decode(t, max_numel=100)
    assert len(calls) == n


def test_encode_tensor_takes_encodes_keywords_only() -> None:
    with pytest.raises(TypeError, match="codingg"):
        dqsgd.encode_tensor(_x(), codingg="fixed")
    with pytest.raises(TypeError):
        dqsgd.encode_tensor(_x(), 4)  # keywords only, as encode
