"""DQSGD inside FSDP2 training: MNIST, an MLP with ``fully_shard`` on every block, W gloo ranks on CPU.

    torchrun --standalone --nproc-per-node 4 examples/fsdp_train.py
    python examples/fsdp_train.py --world 4          # starts the 4 processes itself on 127.0.0.1

For each seed it trains the same model with FSDP's own fp32 reduce-scatter and with each dqsgd
method, and prints the test accuracy, the final training loss and the gradient bytes each rank handed
to the process group per step. The only dqsgd lines are the two marked ``<- dqsgd`` in ``build``
(through :func:`dqsgd.cli.bench.fsdp.mlp`): ``FSDPState(...)`` and ``compress(model, state)``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dqsgd.cli.bench.fsdp import gradient_bytes, mlp
from dqsgd.data import load_dataset

SIZES = [784, 256, 256, 10]


def run(data: Any, rank: int, world: int, variant: str, seed: int, steps: int, batch: int,
        lr: float) -> dict[str, float]:
    model, state = mlp(SIZES, world, variant, steps, seed)  # fully_shard per Linear; dqsgd: FSDPState + compress
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    order = torch.randperm(data.train.x.shape[0], generator=torch.Generator().manual_seed(seed))
    mine = order[rank::world]  # each rank its own shard of the training set
    losses = []
    for s in range(steps):
        idx = mine[(s * batch) % (mine.numel() - batch):][:batch]
        loss = F.cross_entropy(model(data.train.x[idx].reshape(batch, -1)), data.train.y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():  # every rank scores its slice of the test set; the counts are summed
        x, y = data.test.x[rank::world], data.test.y[rank::world]
        right = torch.tensor([float((model(x.reshape(x.shape[0], -1)).argmax(1) == y).sum()), float(y.numel())])
    dist.all_reduce(right)
    nbytes = gradient_bytes(model, variant, state, world)
    return {"acc": float(right[0] / right[1]), "loss": statistics.mean(losses[-20:]),
            "bytes": nbytes / steps if state is not None else nbytes}


def main_rank(rank: int, world: int, args: argparse.Namespace) -> dict[tuple[str, int], dict[str, float]]:
    torch.set_num_threads(1)
    data, out = load_dataset("mnist"), {}
    for seed in args.seeds:
        for variant in ["fsdp fp32", *args.methods]:
            out[(variant, seed)] = run(data, rank, world, variant, seed, args.steps, args.batch, args.lr)
            if rank == 0:
                r = out[(variant, seed)]
                print(f"seed {seed} {variant:<10} test acc {r['acc']:.4f}  loss {r['loss']:.4f}  "
                      f"grad bytes/rank/step {r['bytes']:,.0f}", flush=True)
    return out


def summary(results: dict[tuple[str, int], dict[str, float]], args: argparse.Namespace) -> None:
    print(f"\nMNIST, MLP {SIZES}, W = {args.world}, {args.steps} steps, batch {args.batch}/rank, seeds {args.seeds}")
    print(f"{'variant':<10} {'test acc (mean, min-max)':>26} {'loss':>8} {'grad bytes/rank/step':>21}")
    for variant in ["fsdp fp32", *args.methods]:
        rows = [results[(variant, s)] for s in args.seeds]
        accs = [r["acc"] for r in rows]
        print(f"{variant:<10} {statistics.mean(accs):>12.4f} ({min(accs):.4f}-{max(accs):.4f}) "
              f"{statistics.mean(r['loss'] for r in rows):>8.4f} {statistics.mean(r['bytes'] for r in rows):>21,.0f}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="qsgd-4bit,dqsgd", type=lambda s: s.split(","))
    p.add_argument("--seeds", default="0,1,2", type=lambda s: [int(v) for v in s.split(",")])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--world", type=int, default=4, help="processes to start (without torchrun)")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        args.world = dist.get_world_size()
        res = main_rank(dist.get_rank(), args.world, args)
        if dist.get_rank() == 0:
            summary(res, args)
        dist.destroy_process_group()
    else:
        from dqsgd.cli.launch import spawn_local

        ranks = spawn_local(main_rank, args.world, (args,), timeout=120, deadline=3600)
        if not all(r.ok for r in ranks):
            raise SystemExit("; ".join(r.describe() for r in ranks if not r.ok))
        summary(ranks[0].value, args)
