"""Wire format of a sparse vector with quantized values (top-k / random-k messages).

A message of k of d coordinates is two parts, back to back:

1. an INDICES message of :mod:`dqsgd.codecs.sketch_wire` (magic ``DK``, d, k, the k increasing
   indices packed at ⌈log2 d⌉ bits, crc32);
2. for k > 0, a project payload (:mod:`dqsgd.codecs.wire`, FIXED coding) of the k values: UNIFORM at
   b bits with one scale (the quantized values), or IDENTITY (fp32 values, b = 32).

Exact size (:func:`sparse_message_size`): ``index_message_size(d, k) + predicted_size(k, b)``, the
second part absent for k = 0 — what the ledger records is the length of the bytes sent, and the tests
check it equals this prediction. The decoder (:func:`decode_sparse`) takes d, the most coordinates
it accepts and the values' scheme and width, and refuses (PayloadError) anything else: a malformed
index part (as :func:`~dqsgd.codecs.sketch_wire.decode_indices` does), a values payload of another
scheme, width or count, trailing bytes, or a k = 0 message with values.
"""

from __future__ import annotations

import torch

from dqsgd.codecs.header import Coding, PayloadError
from dqsgd.codecs.sketch_wire import IndexKind, decode_indices, encode_indices, index_message_size
from dqsgd.codecs.wire import decode, encode, predicted_size
from dqsgd.quantizers.base import Layout, Quantized, Scheme

__all__ = ["decode_sparse", "encode_sparse", "sparse_message_size"]


def sparse_message_size(d: int, k: int, bits: int) -> int:
    """The exact length of a message of ``k`` of ``d`` coordinates whose values take ``bits`` (32: fp32)."""
    values = 0 if k == 0 else predicted_size(k, bits, 0 if bits == 32 else 1, 1, Layout(), Coding.FIXED)
    return index_message_size(d, k, IndexKind.INDICES) + values


def encode_sparse(indices: torch.Tensor, d: int, values: Quantized) -> bytes:
    """The message of ``indices`` (increasing, < d) and their quantized ``values`` (k elements, FIXED-coded)."""
    k = int(indices.numel())
    if values.numel != k or len(values.shape) != 1:
        raise ValueError(f"{k} indices need a 1-D values message of {k} elements, got shape {values.shape}")
    head = encode_indices(indices, d)
    return head if k == 0 else head + encode(values, Coding.FIXED)


def decode_sparse(payload: bytes | bytearray | memoryview, d: int, max_k: int, scheme: Scheme,
                  bits: int) -> tuple[torch.Tensor, Quantized | None]:
    """(indices int64, the values message or None for k = 0) of a message for a ``d``-vector of at most
    ``max_k`` coordinates whose values are ``scheme`` at ``bits``."""
    buf = memoryview(payload).cast("B")
    if len(buf) < 12:
        raise PayloadError(f"sparse message truncated: {len(buf)} bytes, its index header needs 12")
    k = int.from_bytes(buf[8:12], "little")
    cut = index_message_size(d, min(k, max_k, d), IndexKind.INDICES)
    idx, _ = decode_indices(buf[:cut], d, max_k, IndexKind.INDICES)
    rest = buf[cut:]
    if k == 0:
        if len(rest):
            raise PayloadError(f"sparse message of no coordinates carries {len(rest)} bytes of values (offset {cut})")
        return idx, None
    q = decode(rest, max_numel=k)
    if q.scheme != scheme or q.bits != bits or q.numel != k or len(q.shape) != 1:
        raise PayloadError(f"sparse message values at offset {cut}: expected {scheme.name} of {k} values at {bits} "
                           f"bits, got {Scheme(q.scheme).name} of shape {tuple(q.shape)} at {q.bits} bits")
    return idx, q
