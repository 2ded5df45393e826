"""Gradient codecs for the uplink (worker → master): fp32, LP(b), and sparsified LP(b).

A codec is a small frozen dataclass with two pure functions; randomness comes only from the
``torch.Generator`` passed in (each worker owns one; it is not shared across workers):

    payload = codec.encode(alpha, generator)      # worker
    alpha_hat = codec.decode(payload, d)           # master (raises PayloadError on bad input)

* :class:`Fp32Grad` — AsyFPG / Acc-AsyFPG: raw float32 through the project codec (IDENTITY).
* :class:`LowPrecGrad` — AsyLPG / Acc-AsyLPG / QSVRG: Q_(δα,b)(α) with δ_α = ‖α‖_∞/(2^(b−1) − 1)
  (no clipping, unbiased) [third-party + docs/algorithms.md §9.2], project codec, FIXED coding.
* :class:`SparseLowPrecGrad` — Sparse-AsyLPG: Q_(δ,b)(S(α)) with budget φ = d/phi_div
  (:mod:`dqsgd.dq.sparse`), in the sparse format of :mod:`dqsgd.dq.sparse_wire`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dqsgd.codecs import Coding, PayloadError, decode, encode
from dqsgd.dq.sparse import sparse_dequantize, sparse_quantize
from dqsgd.dq.sparse_wire import decode_sparse, encode_sparse
from dqsgd.quantizers import Scheme, dequantize, quantize_identity, quantize_lowprec

__all__ = ["GradCodec", "Fp32Grad", "LowPrecGrad", "SparseLowPrecGrad"]


class GradCodec(Protocol):
    name: str

    @property
    def nominal_bits(self) -> int:
        """Intended bits per coordinate (the ledger's ``bits`` field)."""
        ...

    def encode(self, alpha: torch.Tensor, generator: torch.Generator | None) -> bytes: ...

    def decode(self, payload: bytes, d: int) -> torch.Tensor: ...


def _dense(payload: bytes, d: int, scheme: Scheme) -> torch.Tensor:
    q = decode(payload, max_numel=d)
    if q.scheme != scheme or q.numel != d:
        raise PayloadError(f"gradient message: {q.scheme.name} of {q.numel} elements, expected {scheme.name} of {d}")
    return dequantize(q).reshape(-1)


@dataclass(frozen=True)
class Fp32Grad:
    name: str = "fp32"

    @property
    def nominal_bits(self) -> int:
        return 32

    def encode(self, alpha: torch.Tensor, generator: torch.Generator | None) -> bytes:
        return encode(quantize_identity(alpha.reshape(-1)), Coding.FIXED)

    def decode(self, payload: bytes, d: int) -> torch.Tensor:
        return _dense(payload, d, Scheme.IDENTITY)


@dataclass(frozen=True)
class LowPrecGrad:
    bits: int = 4
    name: str = "lp"

    @property
    def nominal_bits(self) -> int:
        return self.bits

    def encode(self, alpha: torch.Tensor, generator: torch.Generator | None) -> bytes:
        return encode(quantize_lowprec(alpha.reshape(-1), self.bits, generator), Coding.FIXED)

    def decode(self, payload: bytes, d: int) -> torch.Tensor:
        return _dense(payload, d, Scheme.LOWPREC)


@dataclass(frozen=True)
class SparseLowPrecGrad:
    """φ = d/phi_div expected survivors [OC default phi_div = 16, §9.3]."""

    bits: int = 4
    phi_div: float = 16.0
    name: str = "sparse-lp"

    @property
    def nominal_bits(self) -> int:
        return self.bits

    def phi(self, d: int) -> float:
        return d / self.phi_div

    def encode(self, alpha: torch.Tensor, generator: torch.Generator | None) -> bytes:
        return encode_sparse(sparse_quantize(alpha, self.phi(alpha.numel()), self.bits, generator))

    def decode(self, payload: bytes, d: int) -> torch.Tensor:
        msg = decode_sparse(payload, max_d=d)
        if msg.d != d:
            raise PayloadError(f"sparse gradient of length {msg.d}, expected {d}")
        return sparse_dequantize(msg)
