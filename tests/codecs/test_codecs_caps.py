"""The codec's caps: the most bytes a payload of n elements can take (every coding, measured at the
extremes), the public decode's memory cap (measured as peak RSS), and a forged scale that would
overflow the tensor's own dtype."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

import dqsgd
from dqsgd.codecs import Coding, PayloadError, decode, encode
from dqsgd.codecs.bounds import max_body_bytes, max_payload_bytes
from dqsgd.codecs.wire import predicted_size
from dqsgd.quantizers import Layout, Norm, Quantized, Scheme, dequantize

BODY_CODINGS = (Coding.FIXED, Coding.ZSTD, Coding.ZSTD_ALIGNED, Coding.ELIAS, Coding.RANS, Coding.RANSX)


def _codes(kind: str, n: int, bits: int, rng: np.random.Generator) -> np.ndarray:
    """The inputs that make each coding longest: every code at the largest magnitude (Elias), or
    uniformly random over the whole range (rANS, zstd), or all zeros."""
    lo, hi = (-1, 1) if bits == 1 else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    if kind == "top":
        c = np.full(n, lo, dtype=np.int32)
    elif kind == "random":
        c = rng.integers(lo, hi + 1, n, dtype=np.int32)
    else:
        c = np.zeros(n, dtype=np.int32)
    if bits == 1:
        c[c == 0] = 1
    return c


@pytest.mark.parametrize("bits", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("n", [0, 1, 7, 1000, 70_000])
@pytest.mark.parametrize("kind", ["top", "random", "zeros"])
def test_every_encoded_payload_fits_max_payload_bytes(bits: int, n: int, kind: str) -> None:
    rng = np.random.default_rng(n * 31 + bits)
    codes = torch.from_numpy(_codes(kind, n, bits, rng))
    layout = Layout(bucket=512)
    nseg = layout.num_segments(n)
    q = Quantized(Scheme.LOWPREC, bits, 1, codes, torch.ones(nseg), layout, (n,), Norm.MAX)
    sizes = {c: len(encode(q, c)) for c in (*BODY_CODINGS, Coding.AUTO)}
    for c, size in sizes.items():
        assert size <= max_payload_bytes(n, bits, layout=layout, coding=c), (c, size)
    assert max(sizes.values()) <= max_payload_bytes(n, bits, layout=layout)
    assert sizes[Coding.FIXED] == max_payload_bytes(n, bits, layout=layout, coding=Coding.FIXED) \
        == predicted_size(n, bits, nseg, 1, layout)
    if kind == "top" and n >= 1000:  # Elias's bound is its exact length on its worst input
        assert max_payload_bytes(n, bits, layout=layout, coding=Coding.ELIAS) - sizes[Coding.ELIAS] <= 2


@pytest.mark.parametrize("n", [0, 5, 100_000])
def test_identity_payloads_fit(n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    for coding in ("fixed", "zstd", "zstd-aligned", "auto"):
        payload = dqsgd.encode(x, scheme="identity", bits=32, coding=coding)
        assert len(payload) <= max_payload_bytes(n, 32, coding=Coding.from_name(coding))
    assert max_payload_bytes(n, 32) >= 4 * n
    with pytest.raises(ValueError, match="RANS"):
        max_body_bytes(n, 32, Coding.RANS)


# --- a forged scale (crc fixed) must fit the tensor's dtype ------------------------------------------
def _forge_scale(payload: bytes, scale: float) -> bytes:
    at = 12 + 4 + 1  # fixed fields, one dim, layout kind 0: the one scale
    unsigned = payload[:at] + struct.pack("<f", scale) + payload[at + 4 : -4]
    return unsigned + struct.pack("<I", zlib.crc32(unsigned))


@pytest.mark.parametrize("dtype,forged", [(torch.float16, 1e5), (torch.bfloat16, 3.4e38)])
@pytest.mark.parametrize("coding", ["fixed", "elias", "rans", "zstd"])
def test_forged_scale_beyond_the_dtype_is_refused(dtype: torch.dtype, forged: float, coding: str) -> None:
    """Scale times the top level must fit the payload's dtype (float16 tops at 65504, bfloat16 at
    3.39e38, below float32's 3.40e38): else the decode would be ±inf."""
    x = torch.tensor([1.0, -0.5, 0.25, 1.0], dtype=dtype)
    payload = dqsgd.encode(x, bits=4, coding=coding, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(dqsgd.decode(_forge_scale(payload, 6e4))).all()  # fits both
    bad = _forge_scale(payload, forged)
    with pytest.raises(ValueError, match="beyond"):
        dqsgd.decode(bad)
    with pytest.raises(ValueError, match="beyond"):
        dequantize(decode(bad))


# --- the public decode's memory cap, measured ------------------------------------------------------
_MEASURE = r'''
import gc, json, sys, zlib
import torch
import dqsgd
from dqsgd.api import DEFAULT_MAX_DECODE_BYTES, decode_bytes_per_element
from dqsgd.codecs import Coding, PayloadError, encode
from dqsgd.quantizers import Layout, Norm, Quantized, Scheme

def status():
    d = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(d["VmRSS"].split()[0]) << 10, int(d["VmHWM"].split()[0]) << 10

def payload(coding, dtype, n, scheme):
    if coding in (Coding.ELIAS, Coding.RANS, Coding.RANSX) and n > 8:  # all-zero bodies do not depend on n: forge the dims
        small = bytearray(payload(coding, dtype, 5, scheme)[:-4])
        small[12:16] = n.to_bytes(4, "little")
        return bytes(small) + zlib.crc32(small).to_bytes(4, "little")
    bits = 32 if scheme == Scheme.IDENTITY else 2
    codes = torch.zeros(0 if bits == 32 else n, dtype=torch.int32)
    values = torch.zeros(n) if bits == 32 else None
    q = Quantized(scheme, bits, 1, codes, torch.ones(0 if bits == 32 else 1), Layout(), (n,), Norm.MAX, values, dtype)
    return encode(q, coding)

cases = json.loads(sys.argv[1])
for coding, dtype, scheme, _ in cases:  # compile and warm up every path
    dqsgd.decode(payload(Coding[coding], getattr(torch, dtype), 1 << 19, Scheme[scheme]))
out = []
for coding, dtype, scheme, n in cases:
    coding, dtype, scheme = Coding[coding], getattr(torch, dtype), Scheme[scheme]
    if n == 0:  # the most the default cap lets through
        n = DEFAULT_MAX_DECODE_BYTES // decode_bytes_per_element(coding, 32 if scheme == Scheme.IDENTITY else 2,
                                                                 dtype, scheme)
    p = payload(coding, dtype, n, scheme)
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")
    before = status()[0]
    try:
        x = dqsgd.decode(p)
        peak = status()[1] - before
        ok = bool(x.numel() == n and x.dtype == dtype and not x.any())
    except PayloadError as e:
        peak = status()[1] - before
        ok = "refused: " + str(e)
    x = None
    out.append([coding.name, str(dtype), n, ok, peak, len(p)])
print(json.dumps(out))
'''

CAP_CASES = [("FIXED", "float32", "UNIFORM"), ("ELIAS", "float32", "UNIFORM"), ("RANS", "float16", "UNIFORM"),
             ("ZSTD_ALIGNED", "float32", "UNIFORM"), ("ELIAS", "float64", "UNIFORM"), ("RANS", "bfloat16", "UNIFORM"),
             ("FIXED", "float64", "UNIFORM"), ("ZSTD", "float32", "IDENTITY")]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS from /proc/self (Linux)")
def test_default_decode_cap_holds_for_every_dtype_and_coding() -> None:
    """A payload of a few bytes may declare 2^26 elements (the documented cap): the public decode
    either refuses it or stays within 256 MiB of peak RSS; at the largest count the cap lets
    through, it decodes within 256 MiB too. Measured as the growth of VmHWM (reset first)."""
    cases = [[*c, 1 << 26] for c in CAP_CASES] + [[*c, 0] for c in CAP_CASES]
    proc = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    slack = 12 << 20  # the interpreter's own small allocations and one narrowing chunk
    for (coding, dtype, n, ok, peak, size), case in zip(json.loads(proc.stdout), cases):
        assert size < 20 << 20
        assert peak <= (256 << 20) + slack, f"{coding} {dtype}: {n} elements took {peak >> 20} MiB"
        if case[3] == 0:
            assert ok is True, (coding, dtype, n, ok)
        else:
            assert ok is True or "default cap of 256 MiB" in ok, ok


# --- a FIXED body's length is checked before anything of the declared numel is allocated ---------------
_FORGED_FIXED = r'''
import json, zlib
import torch
import dqsgd
from dqsgd.kernels.device import decode_device

def hwm():
    d = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(d["VmHWM"].split()[0]) << 10

small = bytearray(dqsgd.encode(torch.randn(1000), bits=4)[:-4])
small[12:16] = (1 << 26).to_bytes(4, "little")  # the one dim: 2^26 elements, the body stays 500 bytes
p = bytes(small) + zlib.crc32(small).to_bytes(4, "little")
dqsgd.decode(dqsgd.encode(torch.randn(1000), bits=4))  # warm both paths up
decode_device(torch.frombuffer(bytearray(dqsgd.encode(torch.randn(1000), bits=4)), dtype=torch.uint8))
out = []
for name, fn in (("decode", lambda: dqsgd.decode(p)),
                 ("decode_device", lambda: decode_device(torch.frombuffer(bytearray(p), dtype=torch.uint8)))):
    open("/proc/self/clear_refs", "w").write("5")
    before = hwm()
    try:
        fn()
        said = "decoded"
    except Exception as e:  # noqa: BLE001 - the test reads the type and the text
        said = f"{type(e).__name__}: {e}"
    out.append([name, said, hwm() - before])
print(json.dumps([len(p), out]))
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS from /proc/self (Linux)")
def test_a_fixed_body_too_short_for_its_numel_is_refused_before_allocating() -> None:
    """L4: a 529-byte FIXED payload declaring 2^26 elements (within the default cap) made ``decode`` and
    the device decoder allocate 256 MiB before the body's length was checked; the length is now
    checked with the header. Measured as the growth of VmHWM (reset first) in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", _FORGED_FIXED], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    size, results = json.loads(proc.stdout)
    assert size == 529
    for name, said, growth in results:
        assert said.startswith("PayloadError: body at offset") and f"{1 << 26}×4 bits need" in said, (name, said)
        assert growth < 32 << 20, f"{name}: peak RSS grew by {growth >> 20} MiB before the refusal"
