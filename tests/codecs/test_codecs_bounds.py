"""Bounded decode: a body of L bytes is refused before allocation when it cannot carry the numel
its header declares, and the public decode's cap and ``numel=`` check."""

from __future__ import annotations

import struct
import tracemalloc
import zlib

import numpy as np
import pytest
import torch
import zstandard

import dqsgd
from dqsgd.api import DEFAULT_MAX_NUMEL
from dqsgd.codecs import Coding, PayloadError, decode, encode
from dqsgd.codecs.rans import rans_encode
from dqsgd.codecs.bounds import rans_numel_bound, zstd_content_bound
from dqsgd.quantizers import Layout, Norm, Quantized, Scheme


def _with_numel(payload: bytes, numel: int) -> bytes:
    """A 1-D payload whose dims field says ``numel`` (crc recomputed, so the forged size reaches
    the checks behind the crc)."""
    assert payload[7] & 15 == 1
    unsigned = payload[:12] + struct.pack("<I", numel) + payload[16:-4]
    return unsigned + struct.pack("<I", zlib.crc32(unsigned))


def _peak_while_refusing(payload: bytes, match: str, **kw) -> int:
    tracemalloc.start()
    try:
        with pytest.raises(PayloadError, match=match):
            dqsgd.decode(payload, **kw)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _sparse_codes(n: int) -> np.ndarray:
    codes = np.zeros(n, dtype=np.int32)
    codes[n // 2] = 1
    return codes


@pytest.mark.parametrize("n", [1, 2**12, 2**20, 2**22])
def test_rans_bound_holds_and_is_not_loose(n: int) -> None:
    """Two symbols, one of them once: the cheapest body there is for n codes."""
    body = rans_encode(_sparse_codes(n), 2)
    assert n <= rans_numel_bound(body.size)
    if n >= 2**22:  # the bound is within a small factor of the best case (0.53 measured at 2^22)
        assert n > rans_numel_bound(body.size) / 4


@pytest.mark.parametrize("n", [1, 2**20, 2**23])
def test_zstd_bound_holds_on_the_most_compressible_input(n: int) -> None:
    frame = zstandard.ZstdCompressor(level=3).compress(bytes(n))
    assert n <= zstd_content_bound(len(frame))
    if n >= 2**23:
        assert n > zstd_content_bound(len(frame)) / 4


def test_forged_rans_numel_is_refused_before_allocation() -> None:
    """A 42-byte RANS payload with two symbols, forged to declare 2^28 elements."""
    x = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0])
    payload = _with_numel(dqsgd.encode(x, bits=2, coding="rans", generator=torch.Generator().manual_seed(0)), 2**28)
    assert len(payload) <= 42
    peak = _peak_while_refusing(payload, "RANS body .* carry fewer than", max_numel=2**28)
    assert peak < 1 << 20, f"decode allocated {peak} bytes before refusing"


def test_forged_zstd_numel_is_refused_before_allocation() -> None:
    payload = _with_numel(dqsgd.encode(torch.ones(5), coding="zstd"), 2**28)
    peak = _peak_while_refusing(payload, "cannot decompress", max_numel=2**28)
    assert peak < 1 << 20


def test_constant_rans_and_sparse_elias_bodies_are_not_bounded_by_their_length() -> None:
    """One symbol costs no bits, nor do trailing zeros in Elias: tiny valid bodies of big tensors
    decode (the cap is the only bound there)."""
    n = 3 * 2**20
    q = Quantized(Scheme.UNIFORM, 4, 7, torch.zeros(n, dtype=torch.int32), torch.ones(1), Layout(), (n,), Norm.MAX)
    for coding in (Coding.RANS, Coding.RANSX, Coding.ELIAS):
        payload = encode(q, coding)
        assert len(payload) < (100 if coding == Coding.RANSX else 40)  # RANSX: 8 states of 8 bytes
        assert torch.equal(decode(payload).codes, q.codes)


def test_forged_one_symbol_rans_body_is_refused_before_allocation() -> None:
    """A one-symbol body never moves the state, so anything but table + L is refused at once."""
    n = 3 * 2**20
    q = Quantized(Scheme.UNIFORM, 4, 7, torch.full((n,), -3, dtype=torch.int32), torch.ones(1), Layout(), (n,),
                  Norm.MAX)
    good = encode(q, Coding.RANS)
    body = bytes.fromhex("01" "05" "808004" "00008000")  # K = 1, symbol -3 + 8, frequency 2^16, state 2^23
    assert good.endswith(body + good[-4:])
    length_at = len(good) - 4 - len(body) - 4
    for forged_body in ("01058080040000800001", "010580800400018000", "0105808004000080", "01858080040000800000",
                        "0105808005000080"):
        forged_body = bytes.fromhex(forged_body)
        unsigned = good[:length_at] + struct.pack("<I", len(forged_body)) + forged_body
        peak = _peak_while_refusing(unsigned + struct.pack("<I", zlib.crc32(unsigned)), "RANS body",
                                    max_numel=2**28)
        assert peak < 1 << 20


def test_forged_elias_body_is_refused_before_allocation() -> None:
    """An Elias body cannot bound numel, but a short one is validated before numel codes are allocated."""
    good = _with_numel(dqsgd.encode(torch.tensor([0.0, 1.0, 0.0, -1.0, 0.0]), coding="elias"), 2**28)
    length_at = 12 + 4 + 1 + 4  # fixed fields, one dim, layout kind 0, one scale
    body = good[length_at + 4 : -4]
    assert len(good) == 32 and len(body) == 3
    for forged_body in (body + b"\x00", body[:-1], b"\xff" + body[1:]):
        unsigned = good[:length_at] + struct.pack("<I", len(forged_body)) + forged_body
        peak = _peak_while_refusing(unsigned + struct.pack("<I", zlib.crc32(unsigned)), "Elias body",
                                    max_numel=2**28)
        assert peak < 1 << 20


def test_public_decode_cap_and_numel() -> None:
    """An Elias payload of 30 bytes declaring 2^28 elements is valid, so only the cap refuses it."""
    payload = _with_numel(dqsgd.encode(torch.zeros(5), coding="elias"), 2**28)
    assert len(payload) == 30 and DEFAULT_MAX_NUMEL < 2**28
    peak = _peak_while_refusing(payload, f"more than max_numel={DEFAULT_MAX_NUMEL}")
    assert peak < 1 << 20
    peak = _peak_while_refusing(payload, "the caller expects numel=1000", numel=1000)
    assert peak < 1 << 20
    small = dqsgd.encode(torch.arange(6.0).reshape(2, 3))
    assert dqsgd.decode(small, numel=6).shape == (2, 3)
    with pytest.raises(PayloadError, match="declares 6 elements .* expects numel=7"):
        dqsgd.decode(small, numel=7)
    with pytest.raises(PayloadError, match="declares 6 elements .* expects numel=5"):
        dqsgd.decode(small, numel=5, max_numel=100)
    with pytest.raises(PayloadError, match="max_numel=5"):
        dqsgd.decode(small, max_numel=5)
