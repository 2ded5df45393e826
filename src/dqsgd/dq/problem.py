"""The optimization problem F(x) = f(x) + h(x) on a flat parameter vector x ∈ R^d.

f = (1/n)Σ_i f_i with f_i = cross-entropy of the model at sample i + (λ₂/2)‖x‖² (λ₂ on every
parameter, biases included [OC]); h = λ₁‖x‖₁, handled by its prox (soft-thresholding) [OC, §9.1].
Defaults: logistic regression λ₂ = 1e-4, λ₁ = 0; the MLP uses λ₂ = λ₁ = 0 (h = 0).

The model is a :func:`dqsgd.models.build_model` module whose parameters are views into one flat
buffer, so "evaluate at x" is one ``copy_``. Everything runs on the CPU in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dqsgd.data import load_dataset
from dqsgd.data.idx import IMAGE_STATS
from dqsgd.models import build_model

__all__ = ["ProblemSpec", "Problem", "lbfgs_minimum"]


@dataclass(frozen=True)
class ProblemSpec:
    dataset: str = "mnist"
    model: str = "logreg"          # "logreg" | "mlp" (any image model of dqsgd.models works)
    subset: int = 0                # > 0: seeded stratified training subset (dqsgd.data)
    l2: float = 1e-4               # λ₂ [OC, §9.1]
    l1: float = 0.0                # λ₁ [OC, §9.1]
    seed: int = 0                  # subset choice and initial weights
    init: str = "default"          # "default": PyTorch's init, seeded | "zeros" [OC]
    inputs: str = "normalized"     # "normalized" (dqsgd.data: (x − mean)/std) | "unit" (pixels in [0, 1]) [OC]
    data_root: str = ""

    def __post_init__(self) -> None:
        if self.l2 < 0 or self.l1 < 0 or self.subset < 0:
            raise ValueError("problem: l1, l2 and subset must be >= 0")
        if self.init not in ("default", "zeros"):
            raise ValueError(f"problem: init must be 'default' or 'zeros', got {self.init!r}")
        if self.inputs not in ("normalized", "unit"):
            raise ValueError(f"problem: inputs must be 'normalized' or 'unit', got {self.inputs!r}")


class Problem:
    """Data + model + loss; gradients and losses at arbitrary flat points."""

    def __init__(self, spec: ProblemSpec) -> None:
        self.spec = spec
        ds = load_dataset(spec.dataset, spec.data_root or None, seed=spec.seed, subset=spec.subset or None)
        self.note = ds.note
        self.x_data, self.y_data = ds.train.x, ds.train.y
        if spec.inputs == "unit":  # undo dqsgd.data's normalisation: pixels back in [0, 1]
            if spec.dataset not in IMAGE_STATS:
                raise ValueError(f"problem: inputs='unit' needs an IDX image set {sorted(IMAGE_STATS)}")
            mean, std = IMAGE_STATS[spec.dataset]
            self.x_data = (self.x_data * torch.tensor(std).view(1, -1, 1, 1) + torch.tensor(mean).view(1, -1, 1, 1)
                           ).clamp_(0.0, 1.0)
            self.note += "; pixels rescaled to [0, 1]"
        self.n = len(ds.train)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            self.model = build_model(spec.model, ds)
        params = list(self.model.parameters())
        self.d = sum(p.numel() for p in params)
        x0 = torch.cat([p.detach().reshape(-1) for p in params])
        self.x0 = torch.zeros_like(x0) if spec.init == "zeros" else x0
        self._flat = torch.zeros(self.d)
        off = 0
        for p in params:
            p.data = self._flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        self.params = params

    def _set(self, x: torch.Tensor) -> None:
        self._flat.copy_(x.reshape(-1))

    def grad(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """(1/|I|)Σ_{i∈I} ∇f_i(x)."""
        self._set(x)
        loss = F.cross_entropy(self.model(self.x_data[idx]), self.y_data[idx])
        gs = torch.autograd.grad(loss, self.params)
        g = torch.cat([t.reshape(-1) for t in gs])
        return g.add_(x.reshape(-1), alpha=self.spec.l2) if self.spec.l2 else g

    def full_grad(self, x: torch.Tensor, idx: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """(1/|idx|)Σ_{i∈idx} ∇f_i(x), in chunks (the same sum as :meth:`grad`, less memory)."""
        total = torch.zeros(self.d)
        for part in torch.split(idx, chunk):
            total.add_(self.grad(x, part), alpha=part.numel())
        return total.div_(max(1, idx.numel()))

    @torch.no_grad()
    def loss(self, x: torch.Tensor, chunk: int = 8192) -> float:
        """F(x) on the whole training set."""
        self._set(x)
        ce = sum(float(F.cross_entropy(self.model(xb), yb, reduction="sum"))
                 for xb, yb in zip(torch.split(self.x_data, chunk), torch.split(self.y_data, chunk)))
        xd = x.double()
        reg = 0.5 * self.spec.l2 * float(xd.square().sum()) + self.spec.l1 * float(xd.abs().sum())
        return ce / self.n + reg

    def prox(self, z: torch.Tensor, step: float) -> torch.Tensor:
        """prox_{step·h}(z): soft-thresholding by step·λ₁ (identity when λ₁ = 0)."""
        if self.spec.l1 == 0.0:
            return z
        t = step * self.spec.l1
        return torch.sign(z) * (z.abs() - t).clamp_(min=0.0)

    def shards(self, workers: int, generator: torch.Generator) -> list[torch.Tensor]:
        """A seeded random partition of the training indices into ``workers`` near-equal shards."""
        perm = torch.randperm(self.n, generator=generator)
        return [s.sort().values for s in torch.tensor_split(perm, workers)]


def lbfgs_minimum(problem: Problem, max_iter: int = 500, tol: float = 1e-9) -> tuple[float, torch.Tensor]:
    """min F by full-batch L-BFGS (strong Wolfe) from x0, in float64: (F*, x*). Smooth h only (λ₁ = 0)."""
    if problem.spec.l1:
        raise ValueError("lbfgs_minimum: λ₁ > 0 makes F non-smooth; use a proximal method")
    x = problem.x0.clone().double().requires_grad_(True)
    opt = torch.optim.LBFGS([x], lr=1.0, max_iter=max_iter, tolerance_grad=tol, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")
    everything = torch.arange(problem.n)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        xf = x.detach().float()
        g = problem.full_grad(xf, everything, chunk=problem.n)
        x.grad = g.double()
        return torch.tensor(problem.loss(xf), dtype=torch.float64)

    opt.step(closure)
    best = x.detach().float()
    val = problem.loss(best)
    if not math.isfinite(val):
        raise FloatingPointError("lbfgs_minimum diverged")
    return val, best
