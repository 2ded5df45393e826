"""One finite-output rule for every decoder (dqsgd.quantizers.base): host and device, ``decode``,
``decode_into``, the torch-ops device decoder and the Triton kernels (on the CPU through Triton's
interpreter) refuse a payload whose values would not be finite in the output's dtype, before anything
is added, and decode one whose values fit.

``TRITON_INTERPRET=1`` is set before the kernel modules are imported, as tests/kernels/test_kernels_triton.py
does (the interpreter runs the kernels on CPU tensors).
"""

import os
import struct
import zlib

import numpy as np
import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

import dqsgd  # noqa: E402
from dqsgd.codecs import PayloadError, encode  # noqa: E402
from dqsgd.codecs.wire import read_header  # noqa: E402
from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast  # noqa: E402
from dqsgd.kernels import device_common  # noqa: E402
from dqsgd.kernels.codec import fixed_plan  # noqa: E402
from dqsgd.kernels.device import decode_accumulate_device, decode_device, expected_header  # noqa: E402
from dqsgd.quantizers import Layout, Norm, quantize_identity  # noqa: E402

FMAX = float(np.finfo(np.float32).max)
KERNELS = ["torch-ops", pytest.param("triton", marks=pytest.mark.skipif(not device_common.triton_available(),
                                                                        reason="the triton package is not installed"))]


@pytest.fixture(autouse=True)
def default_dispatch():
    yield
    device_common.set_triton(None)


def forge_scale(payload: bytes, scale: float, k: int = 0) -> bytes:
    """``payload`` with its scale ``k`` replaced and its crc made right again."""
    h = read_header(payload)
    at = h.body_start - 4 - 4 * len(h.scales) + 4 * k
    unsigned = payload[:at] + struct.pack("<f", scale) + payload[at + 4 : -4]
    return unsigned + struct.pack("<I", zlib.crc32(unsigned))


def as_tensor(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def half_payload(scale: float) -> bytes:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)).half()
    return forge_scale(dqsgd.encode(x, bits=4, generator=torch.Generator().manual_seed(0)), scale)


@pytest.mark.parametrize("scale", [1e5, 3e38])
@pytest.mark.parametrize("kernels", KERNELS)
def test_device_decode_of_a_float16_payload_beyond_its_dtype_is_refused(kernels: str, scale: float) -> None:
    """E8: a float16 payload whose forged scale is finite but beyond 65504 decoded to ±inf on the device
    (torch ops and Triton) while the host refused it; now every path refuses it, ``defer`` flags it."""
    device_common.set_triton(kernels == "triton")
    p = as_tensor(half_payload(scale))
    with pytest.raises(PayloadError, match="beyond float16"):
        dqsgd.decode(bytes(p.numpy()))  # the host decoder, as before
    with pytest.raises(PayloadError, match="beyond float16"):
        decode_device(p)
    bad = torch.tensor(False)
    decode_device(p, check="defer", bad=bad)
    assert bool(bad)
    bad = torch.tensor(False)
    assert torch.isfinite(decode_device(as_tensor(half_payload(6e4)), check="defer", bad=bad)).all() and not bad


@pytest.mark.parametrize("scale", [1e5, 3e38])
def test_decode_into_a_float16_tensor_refuses_values_beyond_it_and_adds_nothing(scale: float) -> None:
    """E8: ``decode_into(payload, float16 out)`` on the host added ±inf; now it is refused, out unchanged."""
    out = torch.ones(1000, dtype=torch.float16)
    with pytest.raises(PayloadError, match="beyond float16"):
        dqsgd.decode_into(half_payload(scale), out)
    assert torch.equal(out, torch.ones(1000, dtype=torch.float16))
    with pytest.raises(PayloadError, match="beyond float16"):  # w·x̂ is what is added: 0.5·7e4 fits, 2·4e4 not
        dqsgd.decode_into(half_payload(4e4), out, weight=2.0)
    dqsgd.decode_into(half_payload(7e4), out, weight=0.5)
    assert torch.isfinite(out).all()


def top_float32_payload() -> tuple[bytes, int]:
    """A float32 payload at 8 bits (127 levels) whose scale is float32's max: 127·(max/127) rounds to inf."""
    n = 1000
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    return forge_scale(encode_uniform_fast(x, 8, HashRNG(1, 2, 3)), FMAX), n


def test_host_in_place_decoders_refuse_a_scale_that_overflows_float32_before_adding() -> None:
    """The host's in-place decoders (decode_accumulate, FixedPlan.accumulate, decode_into on float32) added
    inf: now the scale's bound at the top code is checked from the header, before the body is read."""
    p, n = top_float32_payload()
    base = torch.randn(n)
    for add in (lambda out: decode_accumulate(p, out), lambda out: dqsgd.decode_into(p, out),
                lambda out: fixed_plan(n, 8, Norm.MAX, Layout()).accumulate(np.frombuffer(p, np.uint8), out)):
        out = base.clone()
        with pytest.raises(PayloadError, match="beyond float32"):
            add(out)
        assert torch.equal(out, base)
    ok = forge_scale(p, 3e38)  # 127·(3e38/127) fits: decoded, and finite
    out = torch.zeros(n)
    decode_accumulate(ok, out)
    assert torch.isfinite(out).all() and float(out.abs().max()) > 1e38
    with pytest.raises(PayloadError, match="beyond float32"):  # the caller's weight counts: 2·3e38 overflows
        decode_accumulate(ok, torch.zeros(n), 2.0)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's numpy adding the deferred inf
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("expected", [False, True], ids=["host-header", "expected-header"])
def test_device_in_place_decoder_refuses_a_scale_that_overflows_float32(kernels: str, expected: bool) -> None:
    """decode_accumulate_device (torch ops, Triton), its header read on the host or expected (no sync):
    ``sync`` refuses and leaves ``out`` untouched, ``defer`` sets the flag without a sync."""
    device_common.set_triton(kernels == "triton")
    p, n = top_float32_payload()
    t, h = as_tensor(p), (expected_header((n,), 8) if expected else None)
    base = torch.randn(n)
    out = base.clone()
    with pytest.raises(PayloadError, match="beyond float32"):
        decode_accumulate_device(t, out, header=h)
    assert torch.equal(out, base)
    bad = torch.tensor(False)
    decode_accumulate_device(t, torch.zeros(n), header=h, check="defer", bad=bad)
    assert bool(bad)
    good = as_tensor(forge_scale(p, 3e38))
    bad, out = torch.tensor(False), torch.zeros(n)
    decode_accumulate_device(good, out, header=h, check="defer", bad=bad)
    want = torch.zeros(n)
    decode_accumulate(bytes(good.numpy()), want)
    assert not bad and torch.equal(out, want)


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_float16_l2_payload_whose_values_fit_is_decoded_everywhere(kernels: str) -> None:
    """The narrowed form is exact: an l2 scale above 65504 whose values all fit float16 is decoded by
    every path, to the same values (the rule refuses values, not scales)."""
    device_common.set_triton(kernels == "triton")
    x = torch.full((4,), 40000.0, dtype=torch.float16)
    p = dqsgd.encode(x, bits=8, norm=2, generator=torch.Generator().manual_seed(0))
    assert float(read_header(p).scales[0]) > 65504
    want = dqsgd.decode(p)
    assert want.dtype == torch.float16 and torch.isfinite(want).all()
    assert torch.equal(decode_device(as_tensor(p)), want)
    out = torch.zeros(4, dtype=torch.float16)
    dqsgd.decode_into(p, out)
    assert torch.equal(out, want)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_raw_values_that_are_not_finite_are_refused_before_adding(bad: float) -> None:
    """An IDENTITY payload whose body holds NaN or Inf (crc made right): decode refused it, while
    decode_accumulate added it; now both refuse, and nothing is added."""
    q = quantize_identity(torch.arange(6, dtype=torch.float32))
    p = bytearray(encode(q))
    h = read_header(bytes(p))
    p[h.body_start + 8 : h.body_start + 12] = struct.pack("<f", bad)
    p[-4:] = struct.pack("<I", zlib.crc32(bytes(p[:-4])))
    with pytest.raises(PayloadError):
        dqsgd.decode(bytes(p))
    out = torch.ones(6)
    with pytest.raises(PayloadError, match="beyond float32 or not finite"):
        decode_accumulate(bytes(p), out)
    assert torch.equal(out, torch.ones(6))


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("kernels", KERNELS)
def test_every_path_judges_the_segments_that_hold_values(kernels: str) -> None:
    """The bound is taken over segments that decode something: a forged scale on an empty segment
    (explicit sizes with a 0) changes no value and every path accepts it alike; on a full one every
    path refuses it."""
    device_common.set_triton(kernels == "triton")
    layout = Layout(sizes=(500, 0, 500))
    p = encode_uniform_fast(torch.randn(1000, generator=torch.Generator().manual_seed(2)), 8, HashRNG(1, 2, 3),
                            layout=layout)
    for k, ok in ((1, True), (2, False)):
        forged = forge_scale(p, FMAX, k)
        got = []
        for add in (lambda out: decode_accumulate(forged, out),
                    lambda out: fixed_plan(1000, 8, Norm.MAX, layout).accumulate(np.frombuffer(forged, np.uint8), out),
                    lambda out: decode_accumulate_device(as_tensor(forged), out),
                    lambda out: decode_accumulate_device(as_tensor(forged), out,
                                                         header=expected_header((1000,), 8, layout=layout))):
            out = torch.zeros(1000)
            try:
                add(out)
                got.append(out)
            except PayloadError as e:
                assert "beyond float32" in str(e)
                got.append(None)
        if ok:
            assert all(g is not None and torch.equal(g, got[0]) for g in got)
        else:
            assert got == [None] * 4
