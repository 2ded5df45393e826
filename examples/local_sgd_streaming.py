"""Streaming Local SGD: the model in F fragments, each exchanged every H steps on a staggered schedule, the
exchange overlapped with the next τ inner steps. Two gloo processes, an MLP of four equal layers.

    python examples/local_sgd_streaming.py                 # starts 2 processes itself on 127.0.0.1
    torchrun --nproc-per-node 2 examples/local_sgd_streaming.py

The same run twice: unfragmented (F = 1, τ = 0) and streaming (F = 4, τ = 4). It prints, from rank 0's
counters (``link_bytes``: what the rank sent and received in the exchanges), the most bytes one step moved
during the schedule (the last step, where the run's final exchanges complete, apart), the total, and the
final loss. The dqsgd lines are marked; the model is NOT wrapped in DDP.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dqsgd.local import LocalSGDOptimizer  # <- dqsgd

STEPS, BATCH, H, WIDTH = 96, 64, 16, 64


def run(rank: int, fragments: int, overlap: int) -> str:
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                          nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = LocalSGDOptimizer(inner, model, local_steps=H, method="qsgd-4bit", rounds=STEPS // H,   # <- dqsgd
                            outer="nesterov", outer_lr=0.7, outer_momentum=0.9, fragments=fragments, overlap=overlap)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of a synthetic task
    w_true = torch.randn(WIDTH, 4, generator=torch.Generator().manual_seed(7))
    per_step = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=data)
        loss = F.cross_entropy(model(x), (x @ w_true).argmax(dim=1))
        opt.zero_grad()
        loss.backward()
        before = opt.link_bytes
        opt.step()  # issues the due fragments' exchanges, applies those issued `overlap` steps ago
        per_step.append(opt.link_bytes - before)
    s = opt.compression_stats()
    return (f"F={fragments} tau={overlap}: {s.rounds} exchanges, peak {max(per_step[:-1])} B in one step, "
            f"total {sum(per_step)} B on rank 0's links, final loss {loss.item():.3f}")


def train(rank: int, world: int) -> list[str]:
    return [run(rank, f, tau) for f, tau in ((1, 0), (4, 4))]


def main() -> None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:  # not under torchrun: start 2 processes here
        from dqsgd.cli.launch import spawn_local

        results = spawn_local(train, 2, timeout=60)
        failed = [r.describe() for r in results if not r.ok]
        if failed:
            raise SystemExit("\n".join(failed))
        print("\n".join(results[0].value))
        return
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    lines = train(dist.get_rank(), dist.get_world_size())
    if dist.get_rank() == 0:
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
