"""Sparse-AsyLPG's gradient: unbiased sparsification, then LP quantization of the survivors.

Sparsifier (docs/algorithms.md §9.3) [recalled; Wangni et al. 2018, cited by the DQ paper], budget φ
(the expected number of non-zeros, up to clipping):

    p_i = min(1, φ·|α_i| / ‖α‖₁),   Z_i ~ Bernoulli(p_i),   S(α)_i = Z_i·α_i / p_i.

E[S(α)] = α. The second moment is E‖S(α)‖² = Σ_i α_i²/p_i = ‖α_C‖₂² + ‖α_{C^c}‖₁·‖α‖₁/φ, where
C = {i : p_i = 1}. Hence, always,

    E‖S(α) − α‖² ≤ ‖α‖₁²/φ ≤ (d/φ)‖α‖₂²      and      E‖S(α)‖² ≤ ‖α‖₂² + ‖α‖₁²/φ,

and E‖S(α)‖² = ‖α‖₁²/φ exactly when no p_i is clipped (C empty). The bound "E‖S(α)‖² ≤ ‖α‖₁²/φ"
that is sometimes quoted (see docs/algorithms.md §9.3) is therefore only true without clipping: α = (1, 0, …), φ = 4 gives
E‖S‖² = 1 > 1/4. The tests check the exact identity, both bounds, and that counterexample.

Every unclipped survivor has |S(α)_i| = ‖α‖₁/φ, so the survivors quantize well with LP(δ, b) at
δ = max_i |S(α)_i| / (2^(b−1) − 1) (no clipping, unbiased) [docs/algorithms.md §9.3]; the composition
is unbiased. Survivors whose LP code is 0 decode to 0 and are not sent (lossless).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dqsgd.quantizers import quantize_lowprec
from dqsgd.quantizers.segments import flat_float, require_finite

__all__ = ["SparseLP", "sparsify", "sparse_quantize", "sparse_dequantize", "keep_probabilities"]


@dataclass(frozen=True, eq=False)
class SparseLP:
    """A sparsified, LP-quantized vector: x̂[indices] = codes·delta, zero elsewhere.

    Fields: d (length), bits (b), delta (δ, float32-representable), indices (int64, strictly
    increasing, in [0, d)), codes (int32, non-zero, |c| ≤ 2^(b−1) − 1).
    """

    d: int
    bits: int
    delta: float
    indices: torch.Tensor
    codes: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.indices.numel())

    def same_as(self, other: "SparseLP") -> bool:
        return (self.d, self.bits, self.delta) == (other.d, other.bits, other.delta) and torch.equal(
            self.indices, other.indices) and torch.equal(self.codes, other.codes)


def keep_probabilities(alpha: torch.Tensor, phi: float) -> torch.Tensor:
    """p_i = min(1, φ|α_i|/‖α‖₁) (all zero for α = 0)."""
    a = flat_float(alpha).abs()
    l1 = float(a.double().sum())
    require_finite(torch.tensor([l1], dtype=torch.float32), "sparsifier")
    if l1 == 0.0:
        return torch.zeros_like(a)
    return (a.double() * (phi / l1)).clamp_(max=1.0).to(torch.float32)


def sparsify(alpha: torch.Tensor, phi: float, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """S(α) as (indices, values): Z_i ~ Bernoulli(p_i), value α_i/p_i at the kept indices."""
    if not phi > 0:
        raise ValueError(f"sparsifier: budget phi must be > 0, got {phi}")
    flat = flat_float(alpha)
    p = keep_probabilities(flat, phi)
    u = torch.rand(flat.numel(), generator=generator, dtype=torch.float32, device=flat.device)
    keep = u < p  # p_i = 0 (α_i = 0) is never kept; p_i = 1 always is
    idx = torch.nonzero(keep).reshape(-1)
    return idx, flat[idx] / p[idx]


def sparse_quantize(alpha: torch.Tensor, phi: float, bits: int, generator: torch.Generator | None) -> SparseLP:
    """Q_(δ,b)(S(α)) restricted to its non-zero codes."""
    idx, vals = sparsify(alpha, phi, generator)
    q = quantize_lowprec(vals, bits, generator)  # δ = max|S(α)_i|/(2^(b−1) − 1): no clipping
    codes = q.codes
    nz = codes != 0
    delta = float(q.scales[0]) if idx.numel() else 0.0
    return SparseLP(int(alpha.numel()), bits, delta, idx.cpu()[nz].to(torch.int64), codes[nz].to(torch.int32))


def sparse_dequantize(msg: SparseLP) -> torch.Tensor:
    out = torch.zeros(msg.d, dtype=torch.float32)
    if msg.count:
        out[msg.indices] = msg.codes.to(torch.float32) * torch.tensor(msg.delta, dtype=torch.float32)
    return out
