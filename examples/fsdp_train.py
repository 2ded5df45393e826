"""DQSGD inside FSDP2 training: MNIST, an MLP with ``fully_shard`` on every block, W gloo ranks on CPU.

    torchrun --standalone --nproc-per-node 4 examples/fsdp_train.py
    python examples/fsdp_train.py --world 4          # starts the 4 processes itself on 127.0.0.1

    python examples/fsdp_train.py --methods "" --param-bits 8,4      # the quantized parameter all-gather
    python examples/fsdp_train.py --nodes 2 --methods "" --replicate qsgd-4bit   # HSDP, 2 nodes x 2 ranks

For each seed it trains the same model with FSDP's own fp32 legs and with each variant — a dqsgd
method on the gradient reduce-scatter, the parameter all-gather at ``--param-bits`` (``ag8``), and
with ``--nodes`` > 1 HSDP (a 2-D mesh, FSDP's own all-reduce across nodes in the first row) with the
cross-node leg through the DDP hook (``rep:<method>``) — and prints the test accuracy, its paired
difference to FSDP's own on the same seed, the final training loss and the gradient bytes each rank
handed to its groups per step. The dqsgd lines are in :func:`dqsgd.cli.bench.fsdp.mlp`:
``FSDPState(...)``, ``HookState(..., mesh.get_group("replicate"))`` and ``compress(model, state, replicate=...)``.
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
        lr: float, nodes: int = 1) -> dict[str, float]:
    model, states = mlp(SIZES, world, variant, steps, seed, nodes)  # fully_shard per Linear; dqsgd: compress
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
    nbytes = gradient_bytes(model, variant, states, world, steps, nodes)
    return {"acc": float(right[0] / right[1]), "loss": statistics.mean(losses[-20:]), "bytes": nbytes / steps}


def main_rank(rank: int, world: int, args: argparse.Namespace) -> dict[tuple[str, int], dict[str, float]]:
    torch.set_num_threads(1)
    data, out = load_dataset("mnist"), {}
    for seed in args.seeds:
        for variant in variants(args):
            out[(variant, seed)] = run(data, rank, world, variant, seed, args.steps, args.batch, args.lr, args.nodes)
            if rank == 0:
                r = out[(variant, seed)]
                print(f"seed {seed} {variant:<16} test acc {r['acc']:.4f}  loss {r['loss']:.4f}  "
                      f"grad bytes/rank/step {r['bytes']:,.0f}", flush=True)
    return out


def variants(args: argparse.Namespace) -> list[str]:
    """FSDP's own first, then the methods, the all-gather widths and the replicate-leg methods."""
    return ["fsdp fp32", *args.methods, *(f"ag{b}" for b in args.param_bits), *(f"rep:{m}" for m in args.replicate)]


def summary(results: dict[tuple[str, int], dict[str, float]], args: argparse.Namespace) -> None:
    mode = f"HSDP {args.nodes} nodes x {args.world // args.nodes}" if args.nodes > 1 else f"W = {args.world}"
    print(f"\nMNIST, MLP {SIZES}, {mode}, {args.steps} steps, batch {args.batch}/rank, seeds {args.seeds}")
    print(f"{'variant':<16} {'test acc (mean, min-max)':>26} {'paired diff per seed (pt)':>28} {'loss':>8} "
          f"{'grad bytes/rank/step':>21}")
    for variant in variants(args):
        rows = [results[(variant, s)] for s in args.seeds]
        accs = [r["acc"] for r in rows]
        diffs = " ".join(f"{100 * (a - results[('fsdp fp32', s)]['acc']):+.2f}" for a, s in zip(accs, args.seeds))
        print(f"{variant:<16} {statistics.mean(accs):>12.4f} ({min(accs):.4f}-{max(accs):.4f}) {diffs:>28} "
              f"{statistics.mean(r['loss'] for r in rows):>8.4f} {statistics.mean(r['bytes'] for r in rows):>21,.0f}")


def _names(s: str) -> list[str]:
    return [v for v in s.split(",") if v]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="qsgd-4bit,dqsgd", type=_names,
                   help="dqsgd methods on the gradient reduce-scatter (any variant of dqsgd.cli.bench.fsdp.variant)")
    p.add_argument("--param-bits", default="", type=lambda s: [int(v) for v in _names(s)],
                   help="widths of the quantized parameter all-gather to run, e.g. 8,4")
    p.add_argument("--nodes", type=int, default=1, help="HSDP: the ranks as NODES x world/NODES (2-D mesh)")
    p.add_argument("--replicate", default="", type=_names, help="HSDP: methods of the compressed cross-node leg")
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
