"""Index messages (Sketched SGD's candidates and sparse updates): exact sizes, round trips, refusals."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from codec_strategies import SETTINGS
from hypothesis import given
from hypothesis import strategies as st

from dqsgd.codecs import PayloadError
from dqsgd.codecs.sketch_wire import IndexKind, decode_indices, encode_indices, index_message_size


@st.composite
def messages(draw: st.DrawFn) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    d = draw(st.integers(1, 5000))
    idx = sorted(draw(st.sets(st.integers(0, d - 1), max_size=min(d, 60))))
    vals = None
    if draw(st.booleans()):
        vals = torch.tensor(draw(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=len(idx), max_size=len(idx))),
                            dtype=torch.float32)
    return d, torch.tensor(idx, dtype=torch.int64), vals


def _kind(vals: torch.Tensor | None) -> IndexKind:
    return IndexKind.INDICES if vals is None else IndexKind.SPARSE


@SETTINGS
@given(msg=messages())
def test_round_trip_and_exact_size(msg: tuple) -> None:
    d, idx, vals = msg
    payload = encode_indices(idx, d, vals)
    assert len(payload) == index_message_size(d, idx.numel(), _kind(vals))
    got, got_vals = decode_indices(payload, d, idx.numel(), _kind(vals))
    assert torch.equal(got, idx)
    assert (got_vals is None) == (vals is None)
    if vals is not None:
        assert torch.equal(got_vals.view(torch.int32), vals.view(torch.int32))


def _sample() -> bytes:
    return encode_indices(torch.tensor([1, 5, 9, 200]), 1000, torch.tensor([1.0, -2.0, 0.5, 3.0]))


def test_every_truncation_bit_flip_and_padding_is_refused() -> None:
    payload = _sample()
    for cut in range(len(payload)):
        with pytest.raises(PayloadError):
            decode_indices(payload[:cut], 1000, 4, IndexKind.SPARSE)
    for bit in range(8 * len(payload)):
        flipped = bytearray(payload)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(PayloadError):
            decode_indices(bytes(flipped), 1000, 4, IndexKind.SPARSE)
    with pytest.raises(PayloadError, match="take"):
        decode_indices(payload + b"\x00", 1000, 4, IndexKind.SPARSE)


def _reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize("d, max_k, kind, match", [
    (999, 4, IndexKind.SPARSE, "expected d = 999"), (1000, 3, IndexKind.SPARSE, "at most 3"),
    (1000, 4, IndexKind.INDICES, "expected 0"),
])
def test_callers_expectations_are_checked(d: int, max_k: int, kind: IndexKind, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        decode_indices(_sample(), d, max_k, kind)


def test_forged_indices_and_values_are_refused_with_a_valid_crc() -> None:
    body = bytearray(_sample()[:-4])
    unsorted = bytearray(encode_indices(torch.tensor([1, 2]), 8)[:-4])
    unsorted[12] = 0b000_010  # index 2 then 0: w = 3 bits
    with pytest.raises(PayloadError, match="strictly increasing"):
        decode_indices(_reseal(bytes(unsorted)), 8, 2, IndexKind.INDICES)
    nan = body[:-4] + struct.pack("<f", float("nan"))
    with pytest.raises(PayloadError, match="non-finite"):
        decode_indices(_reseal(bytes(nan)), 1000, 4, IndexKind.SPARSE)
    padded = bytearray(encode_indices(torch.tensor([3]), 8)[:-4])
    padded[12] |= 0x80
    with pytest.raises(PayloadError, match="padding"):
        decode_indices(_reseal(bytes(padded)), 8, 1, IndexKind.INDICES)
    with pytest.raises(PayloadError, match="magic"):
        decode_indices(_reseal(b"XX" + bytes(body[2:])), 1000, 4, IndexKind.SPARSE)


@SETTINGS
@given(msg=messages(), data=st.data())
def test_mutated_messages_are_refused_or_canonical(msg: tuple, data: st.DataObject) -> None:
    d, idx, vals = msg
    payload = bytearray(encode_indices(idx, d, vals))
    for _ in range(data.draw(st.integers(1, 3))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        payload = bytearray(_reseal(bytes(payload[:-4])))
    try:
        got, got_vals = decode_indices(bytes(payload), d, idx.numel(), _kind(vals))
    except PayloadError:
        return
    assert encode_indices(got, d, got_vals) == bytes(payload)


def test_encoder_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        encode_indices(torch.tensor([3, 3]), 10)
    with pytest.raises(ValueError, match="finite values"):
        encode_indices(torch.tensor([3]), 10, torch.tensor([float("inf")]))
