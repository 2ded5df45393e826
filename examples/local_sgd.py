"""Local SGD with 4-bit pseudo-gradients in your own training loop: two gloo processes, a tiny MLP.

    python examples/local_sgd.py                 # starts 2 processes itself on 127.0.0.1
    torchrun --nproc-per-node 2 examples/local_sgd.py

Each process trains its own copy of the model with its own optimizer; every H = 8 steps the wrapper
quantizes Δ = θ_start − θ (QSGD, 4 bits), exchanges it over the sharded collective and applies the
averaged Δ with an outer Nesterov step. The dqsgd lines are marked; the model is NOT wrapped in DDP.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dqsgd.local import LocalSGDOptimizer  # <- dqsgd

STEPS, BATCH, H = 80, 64, 8


def train(rank: int, world: int) -> list[str]:
    """The run on this rank; rank 0's report lines."""
    lines: list[str] = []
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = LocalSGDOptimizer(inner, model, local_steps=H, method="qsgd-4bit",           # <- dqsgd
                            outer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of a synthetic task
    w_true = torch.randn(20, 4, generator=torch.Generator().manual_seed(7))
    for step in range(STEPS):
        x = torch.randn(BATCH, 20, generator=data)
        y = (x @ w_true).argmax(dim=1)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()  # every H-th step: the compressed exchange of Δ and the outer step
        if rank == 0 and (step + 1) % (4 * H) == 0:
            lines.append(f"step {step + 1:3d}  loss {loss.item():.3f}  rounds {opt.rounds_done}  "
                  f"bytes on rank 0's links {opt.link_bytes}")
    fp32 = 2 * 4 * sum(p.numel() for p in model.parameters()) * STEPS  # a per-step fp32 all-reduce, roughly
    if rank == 0:
        lines.append(f"rank 0 sent and received {opt.link_bytes} B in {opt.rounds_done} exchanges; a per-step fp32 "
              f"exchange would move about {fp32} B ({fp32 / opt.link_bytes:.0f}x more)")
    torch.save(opt.state_dict(), os.devnull)  # the state to resume from exactly (model parameters included)
    return lines


if __name__ == "__main__":
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        print("\n".join(train(dist.get_rank(), dist.get_world_size())))
        dist.destroy_process_group()
    else:
        from dqsgd.cli.launch import spawn_local

        results = spawn_local(train, 2, timeout=60)
        for r in results:
            if not r.ok:
                raise SystemExit(r.describe())
        print("\n".join(results[0].value))
