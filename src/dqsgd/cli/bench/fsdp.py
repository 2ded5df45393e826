"""``dqsgd bench fsdp`` and the FSDP training example: gloo processes on 127.0.0.1, ``fully_shard`` per block.

Both run an MLP whose every ``Linear`` is its own FSDP unit, once with FSDP's own reduce-scatter
(fp32, or bf16 through ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``) and once per dqsgd
method. Bytes are what each rank hands to the process group for gradients per step: FSDP's own
reduce-scatter sends (W−1)/W of its input; dqsgd's are counted by :class:`~dqsgd.fsdp.FSDPState`
(payloads, size exchange, policy statistics, exact warm-up calls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEFAULTS = ("fsdp fp32", "fsdp bf16")


def mlp(sizes: list[int], world: int, variant: str, total_steps: int, seed: int) -> tuple[nn.Module, Any]:
    """An MLP of ``sizes`` with each Linear (and the root) fully_shard-ed on a 1-D CPU mesh; ``variant``:
    ``"fsdp fp32"``, ``"fsdp bf16"`` (reduce dtype) or a dqsgd method name. Returns (model, FSDPState or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dqsgd.fsdp import FSDPState, compress

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if variant == "fsdp bf16" else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if variant in DEFAULTS:
        return model, None
    state = FSDPState(variant, seed=seed, total_steps=total_steps, timeout=120)
    compress(model, state)
    return model, state


def gradient_bytes(model: nn.Module, variant: str, state: Any, world: int) -> int:
    """Bytes this rank has handed to the group for gradients so far (per step for FSDP's own: computed)."""
    if state is not None:
        return int(state.stats()["total_sent"])
    itemsize = 2 if variant == "fsdp bf16" else 4
    padded = sum(-(-p.shape[0] // world) * world * p[0].numel() if p.dim() > 1 else -(-p.shape[0] // world) * world
                 for p in model.parameters())
    return (world - 1) * padded * itemsize // world


def _bench_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    out: dict[str, Any] = {}
    for variant in [*DEFAULTS, *args.methods.split(",")]:
        model, state = mlp(sizes, world, variant, args.warmup + args.steps, 0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        times = []
        for s in range(args.warmup + args.steps):
            x = torch.randn(args.batch, sizes[0], generator=gen)
            t0 = time.perf_counter()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if s >= args.warmup:
                times.append(time.perf_counter() - t0)
            if s == args.warmup - 1:
                before = gradient_bytes(model, variant, state, world)
                rs_before = state.seconds if state is not None else 0.0
        total = gradient_bytes(model, variant, state, world)
        per_step = total if state is None else (total - before) / args.steps
        rs_ms = 1000 * (state.seconds - rs_before) / args.steps if state is not None else float("nan")
        out[variant] = {"ms": 1000 * statistics.median(times), "bytes": per_step, "rs_ms": rs_ms}
    return out


def bench_fsdp(args: argparse.Namespace) -> None:
    """Print (and save) gradient bytes per rank per step and step time per variant, W gloo ranks."""
    from dqsgd.cli.launch import spawn_local

    if args.warmup < 1:
        raise ValueError("--warmup must be at least 1 (the bytes are counted after it)")
    plain = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})  # picklable for the ranks
    results = spawn_local(_bench_rank, args.world, (plain,), timeout=args.timeout, threads=args.threads,
                          deadline=args.deadline)
    if not all(r.ok for r in results):
        raise RuntimeError("; ".join(r.describe() for r in results if not r.ok))
    rows = results[0].value
    ref = rows["fsdp fp32"]
    print(f"FSDP2 gradient reduce-scatter, W = {args.world} gloo ranks (CPU), MLP {args.sizes}, batch {args.batch}/rank, "
          f"median of {args.steps} steps after {args.warmup}")
    print(f"{'variant':<14} {'grad bytes/rank/step':>21} {'vs fp32':>8} {'ms/step':>9} {'vs fp32':>8} "
          f"{'ms in dqsgd RS':>15}")
    for name, r in rows.items():
        busiest = max(res.value[name]["bytes"] for res in results)
        print(f"{name:<14} {busiest:>21,.0f} {ref['bytes'] / busiest:>7.2f}x {r['ms']:>9.1f} "
              f"{ref['ms'] / r['ms']:>7.2f}x {r['rs_ms']:>15.1f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(plain), "ranks": [r.value for r in results]},
                                             indent=1, default=str))
        print(f"\nwrote {args.out}")
