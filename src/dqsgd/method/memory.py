"""Error-feedback memory (EF-SignSGD, Karimireddy et al. 2019, and friends), for any quantizer.

Per worker and step [recalled, Alg. "EF-SIGNSGD", written in the gradient domain]:

    p = g + e,   Δ = C(p)  (what is sent),   e ← p − Δ.

The invariant ``p == Δ + e_new`` holds exactly up to float rounding (tested). With a constant
learning rate γ this is the paper's form (p = γg + e) divided by γ; with a changing rate the
gradient-domain form is what is implemented [OC]. The state is an explicit tensor per worker.
"""

from __future__ import annotations

import torch


def compensate(grad: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """p = g + e (e = 0 before the first step)."""
    g = grad.detach().reshape(-1).to(torch.float32)
    if residual is None:
        return g.clone()
    if residual.shape != g.shape:
        raise ValueError(f"error-feedback memory has shape {tuple(residual.shape)}, gradient {tuple(g.shape)}")
    return g + residual


def update(p: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """e_new = p − Δ, where Δ is the decoded value of what was sent."""
    return p - sent.reshape(-1).to(torch.float32)
