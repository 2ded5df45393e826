"""Sparsified vectors with quantized values: top-k and random-k (Local SGD's sparse pseudo-gradients).

A message of a d-vector p keeps k of its coordinates S and sends their indices and their values
quantized by the stochastic uniform quantizer Q_b (max-norm scale over the k values, b bits:
:mod:`dqsgd.quantizers.uniform`, unbiased):

* ``topk``: S = the k coordinates of largest |p_i| (ties: the lower index), values p_S. Biased (the
  rest is dropped); with error feedback (e ← p − x̂, carried into the next round) nothing is lost
  for good: Σ_r x̂_r = Σ_r Δ_r − e_R, and e stays bounded (the tests check both).
* ``randk``: S uniform among the k-subsets (a permutation drawn from the worker's generator), values
  (d/k)·p_S. Unbiased: P(i ∈ S) = k/d, so E[x̂] = E[(d/k)·1_S·p] = p; the variance is
  E‖x̂ − p‖² = (d/k − 1)‖p‖² + E[Σ_{i∈S} var Q_b]; the Monte-Carlo test checks the mean with a
  margin from that variance.

x̂ = the decoded message: x̂_S = Q_b(values), zero elsewhere. Draws from the generator: the
permutation (random-k only), then the k uniforms of Q_b. The wire of a message (indices, then the
values' payload) is :mod:`dqsgd.codecs.sparse_wire`; the exchange that sends them,
:mod:`dqsgd.topology.sparse`.

The registry entries (``topk``, ``randk``) make these schemes usable in a method configuration
(a policy may drive their value width b); a message holds indices, which the one-message
``Quantized`` path does not carry, so :meth:`SparseScheme.quantize` refuses with what runs them.
"""

from __future__ import annotations

import torch

from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme, SchemeQuantizer
from dqsgd.quantizers.segments import flat_float, require_finite
from dqsgd.quantizers.uniform import MAX_BITS, MIN_BITS, quantize_uniform

__all__ = ["RANDK", "SPARSE_SCHEMES", "TOPK", "SparseScheme", "density_count", "select"]

SPARSE_SCHEMES = ("topk", "randk")


def density_count(d: int, ratio: float) -> int:
    """k = max(1, round(ratio·d)) coordinates of d (at most d; 0 for d = 0)."""
    return min(d, max(1, round(ratio * d))) if d else 0


def select(p: torch.Tensor, k: int, kind: str, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(S increasing int64, the values to quantize) of the module docstring for ``kind`` topk | randk."""
    flat = flat_float(p)
    d = flat.numel()
    if not 0 <= k <= d:
        raise ValueError(f"sparsifier: k must be in [0, {d}], got {k}")
    if d:
        require_finite(flat.abs().amax().reshape(1), kind)
    if kind == "topk":
        # stable descending sort of |p|: among equal magnitudes the lower index first (deterministic)
        order = torch.sort(flat.abs(), descending=True, stable=True).indices[:k]
        idx = torch.sort(order).values
        return idx, flat[idx]
    if kind == "randk":
        idx = torch.sort(torch.randperm(d, generator=generator)[:k]).values
        return idx, flat[idx] * (d / k) if k else flat[idx]
    raise ValueError(f"unknown sparsifier {kind!r}; use {' or '.join(SPARSE_SCHEMES)}")


def quantize_values(values: torch.Tensor, bits: int, generator: torch.Generator | None) -> Quantized:
    """Q_b of the kept values: stochastic uniform, one max-norm scale (unbiased)."""
    return quantize_uniform(values, bits, generator, norm=Norm.MAX)


class SparseScheme(SchemeQuantizer):
    """A registry entry of a sparsifier; its value width b is 2..16 and may be chosen by a policy."""

    scheme = Scheme.UNIFORM  # the wire scheme of a message's values
    dynamic = True

    def __init__(self, name: str):
        self.name = name

    def bits_error(self, bits: int) -> str | None:
        if not MIN_BITS <= bits <= MAX_BITS:
            return f"the {self.name} scheme quantizes its kept values with {MIN_BITS}..{MAX_BITS} bits, got {bits}"
        return None

    def quantize(self, x: torch.Tensor, bits: int, generator: torch.Generator | None = None, *,
                 layout: Layout = Layout(), norm: Norm = Norm.MAX, scaled: bool = False,
                 scalers: torch.Tensor | None = None, clip: float | None = None) -> Quantized:
        raise ValueError(f"the {self.name} scheme sends indices and quantized values, which a one-message Quantized "
                         f"payload does not carry: Local SGD runs it (dqsgd.local.LocalSGDOptimizer, or dqsgd train "
                         f"with local_steps; dqsgd.topology.sparse), not a per-step exchange")


TOPK, RANDK = SparseScheme("topk"), SparseScheme("randk")

