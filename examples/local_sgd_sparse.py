"""Local SGD with sparse pseudo-gradients: top-k with error feedback, and top-k under a byte budget that picks
each round's value width and density. Two gloo processes, a small MLP.

    python examples/local_sgd_sparse.py                 # starts 2 processes itself on 127.0.0.1
    torchrun --nproc-per-node 2 examples/local_sgd_sparse.py

The same run three ways: QSGD 4-bit pseudo-gradients; ``topk`` (the largest 1 % of each worker's Δ + its
residual, indices and 2-bit values, error feedback); ``topk-budget`` (0.25 bits per coordinate and round,
indices included: each round the width and density of least predicted error). It prints, from rank 0's
``compression_stats()``, the bytes it sent and the final loss; then saves the budgeted optimizer's state
mid-run, resumes from it, and checks the resumed model is bitwise the uninterrupted one. The dqsgd lines
are marked; the model is NOT wrapped in DDP.
"""

from __future__ import annotations

import datetime
import io
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dqsgd.local import LocalSGDOptimizer  # <- dqsgd

STEPS, BATCH, H, WIDTH = 96, 64, 8, 128


def make(method: str, **options: Any) -> tuple[nn.Module, LocalSGDOptimizer]:
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, LocalSGDOptimizer(inner, model, local_steps=H, method=method, rounds=STEPS // H,  # <- dqsgd
                                    outer="nesterov", outer_lr=0.7, outer_momentum=0.9, **options)


def train(rank: int, model: nn.Module, opt: LocalSGDOptimizer, start: int, stop: int) -> float:
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of a synthetic task
    w_true = torch.randn(WIDTH, 4, generator=torch.Generator().manual_seed(7))
    xs = [torch.randn(BATCH, WIDTH, generator=data) for _ in range(STEPS)]
    loss = torch.tensor(float("nan"))
    for n in range(start, stop):
        loss = F.cross_entropy(model(xs[n]), (xs[n] @ w_true).argmax(dim=1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def run(rank: int, world: int) -> list[str]:
    lines = []
    for method, options in (("qsgd-4bit", {}), ("topk", {}), ("topk-budget", {"target_bits": 0.25})):
        model, opt = make(method, **options)
        loss = train(rank, model, opt, 0, STEPS)
        s = opt.compression_stats()
        lines.append(f"{method:12s} {s.rounds} exchanges, rank 0 sent {s.uplink_sent + s.downlink_sent} B "
                     f"({s.ratio:.0f}x fewer than fp32), final loss {loss:.3f}")
    full = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    model, opt = make("topk-budget", target_bits=0.25)  # stop after 5 rounds and a half, resume from the state
    train(rank, model, opt, 0, 5 * H + H // 2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # <- dqsgd: residual, the budget's state, the outer momentum, ...
    buf.seek(0)
    model, opt = make("topk-budget", target_bits=0.25)
    opt.load_state_dict(torch.load(buf, weights_only=True))  # <- dqsgd
    train(rank, model, opt, 5 * H + H // 2, STEPS)
    same = torch.equal(full, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    lines.append(f"resumed mid-round from state_dict: {'bitwise the same model' if same else 'DIFFERENT model'}")
    if not same:
        raise RuntimeError("the resumed run differs from the uninterrupted one")
    return lines


if __name__ == "__main__":
    from dqsgd.cli.launch import spawn_local, under_torchrun

    if under_torchrun():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        out = run(dist.get_rank(), dist.get_world_size())
        print("\n".join(out) if dist.get_rank() == 0 else "", end="\n" if dist.get_rank() == 0 else "")
        dist.destroy_process_group()
    else:  # start 2 processes here, on 127.0.0.1
        results = spawn_local(run, 2, timeout=60)
        bad = [r.describe() for r in results if not r.ok]
        print("\n".join(bad or results[0].value))
        raise SystemExit(1 if bad else 0)
