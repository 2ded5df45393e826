"""The sparse message format: exact round trips (both index codings, every width, odd sizes, the
zero vector), measured size = predicted size, and a decoder that refuses every corruption."""

import random
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dqsgd.codecs import PayloadError
from dqsgd.dq.sparse import SparseLP, sparse_quantize
from dqsgd.dq.sparse_wire import HEADER_SIZE, IndexCoding, decode_sparse, encode_sparse, index_width, sparse_size


def _msg(d: int, bits: int, phi_div: float, seed: int, zero: bool = False) -> SparseLP:
    g = torch.Generator().manual_seed(seed)
    alpha = torch.zeros(d) if zero else torch.randn(d, generator=g) * torch.rand(d, generator=g) ** 3
    return sparse_quantize(alpha, max(d / phi_div, 1e-3), bits, g)


@settings(max_examples=150)
@given(d=st.integers(1, 3000), bits=st.integers(2, 16), phi_div=st.sampled_from([1.0, 2.0, 4.0, 16.0, 64.0, 1e4]),
       seed=st.integers(0, 2**16), zero=st.booleans())
def test_round_trip_is_exact_for_both_codings(d, bits, phi_div, seed, zero) -> None:
    msg = _msg(d, bits, phi_div, seed, zero)
    sizes = sparse_size(msg)
    for coding in IndexCoding:
        data = encode_sparse(msg, coding)
        assert len(data) == sizes[coding.name]            # measured bytes = predicted bytes
        back = decode_sparse(data)
        assert back.same_as(msg)
        assert encode_sparse(back, coding) == data          # canonical
    auto = encode_sparse(msg)
    assert len(auto) == min(sizes.values()) and decode_sparse(auto).same_as(msg)


def test_elias_wins_for_sparse_and_fixed_for_dense_messages() -> None:
    sparse, dense = _msg(100_000, 4, 64.0, 0), _msg(1000, 4, 1.0, 0)
    assert sparse.count > 0 and encode_sparse(sparse)[4] == IndexCoding.ELIAS
    s = sparse_size(sparse)
    assert s["ELIAS"] < s["FIXED"]
    assert encode_sparse(dense)[4] in (IndexCoding.FIXED, IndexCoding.ELIAS)
    # value information is b bits per code either way; FIXED indices are ⌈log2 d⌉ bits
    assert index_width(100_000) == 17 and index_width(2) == 1 and index_width(1) == 1


@pytest.mark.parametrize("coding", list(IndexCoding))
def test_decoder_refuses_truncation_extension_and_bit_flips(coding) -> None:
    data = encode_sparse(_msg(700, 5, 8.0, 3), coding)
    for n in range(len(data)):
        with pytest.raises(PayloadError):
            decode_sparse(data[:n])
    with pytest.raises(PayloadError):
        decode_sparse(data + b"\x00")
    rng = random.Random(0)
    for _ in range(300):
        pos = rng.randrange(len(data) * 8)
        flipped = bytearray(data)
        flipped[pos // 8] ^= 1 << (pos % 8)
        with pytest.raises(PayloadError):
            decode_sparse(bytes(flipped))


def _forge(head: tuple, index: bytes, values: bytes) -> bytes:
    body = struct.pack("<2sBBBIIfI", *head[:7], len(index)) + index + values
    return body + struct.pack("<I", zlib.crc32(body))


def test_decoder_refuses_forged_messages_with_valid_crc() -> None:
    ok = _forge((b"DS", 1, 4, 0, 16, 2, 0.5), bytes([0x31]), bytes([0x9A]))  # indices 1, 3; codes +2, +1
    assert decode_sparse(ok).count == 2
    bad = {
        "unsorted indices": _forge((b"DS", 1, 4, 0, 16, 2, 0.5), bytes([0x13]), bytes([0x9A])),
        "zero code": _forge((b"DS", 1, 4, 0, 16, 2, 0.5), bytes([0x31]), bytes([0x88])),
        "code -8 out of range": _forge((b"DS", 1, 4, 0, 16, 1, 0.5), bytes([0x01]), bytes([0x00])),
        "count > d": _forge((b"DS", 1, 4, 0, 2, 3, 0.5), bytes([0x06]), bytes([0x9A, 0x09])),
        "bits 17": _forge((b"DS", 1, 17, 0, 16, 0, 0.0), b"", b""),
        "version 2": _forge((b"DS", 2, 4, 0, 16, 0, 0.0), b"", b""),
        "coding 2": _forge((b"DS", 1, 4, 2, 16, 0, 0.0), b"", b""),
        "delta with no codes": _forge((b"DS", 1, 4, 0, 16, 0, 0.5), b"", b""),
        "nan delta": _forge((b"DS", 1, 4, 0, 16, 1, float("nan")), bytes([0x01]), bytes([0x09])),
        "index section length": _forge((b"DS", 1, 4, 0, 16, 2, 0.5), bytes([0x31, 0x00]), bytes([0x9A])),
        "padding bits": _forge((b"DS", 1, 4, 0, 16, 1, 0.5), bytes([0x11]), bytes([0x09])),
        "foreign magic": _forge((b"DQ", 1, 4, 0, 16, 0, 0.0), b"", b""),
    }
    for why, data in bad.items():
        with pytest.raises(PayloadError):
            decode_sparse(data)
            pytest.fail(why)
    with pytest.raises(PayloadError):
        decode_sparse(_forge((b"DS", 1, 4, 0, 1 << 20, 0, 0.0), b"", b""), max_d=1000)


def test_fuzzed_payloads_raise_only_payload_error_or_decode_canonically() -> None:
    rng = np.random.default_rng(0)
    seeds = [encode_sparse(_msg(int(d), int(b), 4.0, int(d)), c)
             for d, b in [(1, 2), (9, 3), (300, 8), (2000, 16)] for c in IndexCoding]
    for _ in range(3000):
        data = bytearray(seeds[rng.integers(len(seeds))])
        for _ in range(int(rng.integers(1, 4))):
            op = rng.integers(3)
            if op == 0 and data:
                data[rng.integers(len(data))] = int(rng.integers(256))
            elif op == 1:
                data = data[: rng.integers(len(data) + 1)]
            else:
                data += bytes(rng.integers(0, 256, int(rng.integers(1, 5)), dtype=np.uint8))
        if rng.random() < 0.5 and len(data) >= HEADER_SIZE + 4:  # fix the crc, so the parser is exercised
            data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
        try:
            msg = decode_sparse(bytes(data))
        except PayloadError:
            continue
        assert encode_sparse(msg, IndexCoding(data[4])) == bytes(data)
