"""Functions run inside the processes of test_local_optimizer.py (importable, so spawned ranks unpickle them)."""

from __future__ import annotations

import io
import time
from typing import Any

import torch
import torch.nn.functional as F

from dqsgd.train.local_sgd import LocalSGDOptimizer
from dqsgd.transport.torch_dist import RankDisagreement

D_IN, CLASSES, BATCH = 20, 4, 8


def make(rank: int, local_steps: int, method: str, rounds: int, **kw: Any) -> tuple[torch.nn.Module, LocalSGDOptimizer]:
    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES))
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, LocalSGDOptimizer(inner, model, local_steps, method, rounds=rounds, timeout=20, **kw)


def train(rank: int, model: torch.nn.Module, opt: LocalSGDOptimizer, start: int, stop: int) -> None:
    """A user's loop: each rank its own data (seeded by rank), batch n of step n."""
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(64, D_IN, generator=g), torch.randint(0, CLASSES, (64,), generator=g)
    for n in range(start, stop):
        i = (n % 8) * BATCH
        opt.zero_grad()
        F.cross_entropy(model(x[i: i + BATCH]), y[i: i + BATCH]).backward()
        opt.step()


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def resume(rank: int, world: int, local_steps: int, steps: int, cut: int, method: str,
           options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A run of ``steps`` steps straight, and one stopped at ``cut`` and continued from its state dict
    (``options``: method options, e.g. error_feedback=True)."""
    kw = {"outer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9, **(options or {})}
    model, opt = make(rank, local_steps, method, steps // local_steps, **kw)
    train(rank, model, opt, 0, steps)
    full, bits, link, down = flat(model), opt.state.bits, opt.link_bytes, dict(opt.state.down_residuals)
    model, opt = make(rank, local_steps, method, steps // local_steps, **kw)
    train(rank, model, opt, 0, cut)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    model, opt = make(rank, local_steps, method, steps // local_steps, **kw)
    opt.load_state_dict(torch.load(buf, weights_only=True))
    train(rank, model, opt, cut, steps)
    residual = opt.state.residuals[opt.rank]
    return {"full": full, "resumed": flat(model), "bits": (bits, opt.state.bits), "link": (link, opt.link_bytes),
            "residual": residual, "down": (down, dict(opt.state.down_residuals))}


def mismatch(rank: int, world: int, what: str) -> dict[str, Any]:
    """Rank 1 sets another H (``what`` = "local_steps") or method ("method"): every rank must refuse."""
    h = 2 if what == "local_steps" and rank == 1 else 4
    method = "qsgd-2bit" if what == "method" and rank == 1 else "qsgd-4bit"
    model, opt = make(rank, h, method, 4)
    t0 = time.monotonic()
    try:
        train(rank, model, opt, 0, 8)
    except RankDisagreement as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def stats(rank: int, world: int, topology: str) -> dict[str, Any]:
    """compression_stats() after 2 rounds of 3 steps (and a seventh step), with link_bytes and the repr."""
    model, opt = make(rank, 3, "qsgd-4bit", 2, topology=topology)
    train(rank, model, opt, 0, 7)
    numel = sum(p.numel() for p in model.parameters())
    return {"stats": opt.compression_stats(), "link": opt.link_bytes, "numel": numel, "repr": repr(opt)}
