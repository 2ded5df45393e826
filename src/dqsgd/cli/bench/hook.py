"""``dqsgd bench hook``: DDP step time with each communication hook, as a ratio to no hook.

One DDP step (forward, backward with the hook, SGD step) of the same model and batch, for: no
hook (DDP's own all-reduce), PyTorch's ``fp16_compress_hook``, PowerSGD rank 1, and
``dqsgd.ddp.hook`` with qsgd-4bit and dqsgd in both topologies. On CPU: 2 gloo processes on
127.0.0.1 (one thread each); with CUDA: world size 1 on NCCL (where ``dqsgd.ddp.hook`` passes the
gradient through: there is nothing to send). The hooks run in interleaved rounds (every hook once
per round, ``--steps`` steps each); each round's step times are divided by that round's no-hook
time, and the median and range of those ratios over the rounds are reported, so a slow moment of
a shared machine moves all hooks of a round alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from dqsgd.cli.bench.choices import HOOKS, MODELS  # the parser's choices (torch-free module)
from dqsgd.topology.registry import HOOK_TOPOLOGIES

CIFAR = (3, 32, 32)


def build(name: str) -> nn.Module:
    """``mlp``: 3072-580-580-10 (2.13M parameters); ``cnn``, ``resnet18``: the shipped models at CIFAR shape."""
    from dqsgd.models import MLP, DatasetInfo, build_model

    torch.manual_seed(0)
    if name == "mlp":
        return MLP(CIFAR, 10, hidden=(580, 580))
    return build_model(name, DatasetInfo(num_classes=10, input_shape=CIFAR))


def register_hook(model: Any, hook: str, total_steps: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import dqsgd.ddp

    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd-1":
        st = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(st, powerSGD_hook.powerSGD_hook)
    elif hook != "none":
        method, topology = hook.split()
        st = dqsgd.ddp.HookState(method, None, total_steps=total_steps, topology=topology)
        model.register_comm_hook(st, dqsgd.ddp.hook)


def _stepper(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def rank_times(rank: int, world: int, models: list[str], hooks: list[str], steps: int, warmup: int,
               rounds: int, batch: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per step, per model and hook, one entry per round (runs inside each rank); under
    ``"<model> cpu"`` the same in CPU seconds of the rank's process (all its threads), which other
    jobs on a shared machine move much less than the wall time."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = torch.cuda.is_available() and torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict[str, dict[str, list[float]]] = {}
    for name in models:
        net = build(name).to(device)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(batch, *CIFAR, generator=g).to(device)
        y = torch.randint(0, 10, (batch,), generator=g).to(device)
        steppers = {}
        for h in hooks:
            # PowerSGD issues collectives from completion callbacks on DDP's group: on gloo, with
            # several buckets, they get out of order across ranks (a size mismatch abort): one bucket.
            cap = {"bucket_cap_mb": 1 << 12} if (h == "powersgd-1" and not cuda) else {}
            model = DDP(copy.deepcopy(net), device_ids=[rank] if cuda else None, **cap)
            register_hook(model, h, total_steps=warmup + rounds * steps + 1)
            steppers[h] = _stepper(model, x, y)
            for _ in range(warmup):
                steppers[h]()
        times: dict[str, list[float]] = {h: [] for h in hooks}
        cpu: dict[str, list[float]] = {h: [] for h in hooks}
        for k in range(rounds):
            if rank == 0:
                print(f"  {name}: round {k + 1}/{rounds}", flush=True)
            for h in hooks:
                sync()
                t, c = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    steppers[h]()
                sync()
                times[h].append((time.perf_counter() - t) / steps)
                cpu[h].append((time.process_time() - c) / steps)
        out[name], out[f"{name} cpu"] = times, cpu
    return out


def summarize(times: dict[str, list[float]], pairs: list[tuple[str, str]] = ()) -> list[dict[str, Any]]:
    """Per hook: median step (ms) and the median, min and max over rounds of step / no-hook step; then,
    per (a, b) of ``pairs`` (and qsgd-4bit against fp16 where both ran), the same of step a / step b."""
    rows = []
    for h, ts in times.items():
        ratios = [t / base for t, base in zip(ts, times["none"])]
        rows.append({"hook": h, "ms": 1e3 * statistics.median(ts), "ratio": statistics.median(ratios),
                     "min": min(ratios), "max": max(ratios)})
    pairs = [*pairs, *((f"qsgd-4bit {topo}", "fp16") for topo in HOOK_TOPOLOGIES)]
    for num, den in dict.fromkeys(pairs):  # each pair once, where both of its hooks ran
        if num in times and den in times:
            r = [a / b for a, b in zip(times[num], times[den])]
            rows.append({"hook": f"{num} / {den}", "ms": float("nan"), "ratio": statistics.median(r),
                         "min": min(r), "max": max(r)})
    return rows


def known_hook(hook: str) -> bool:
    """One of :data:`HOOKS`, or ``"<registered dqsgd method> <sharded|allgather>"``."""
    from dqsgd.method.config import method_config

    method, _, topology = hook.partition(" ")
    if hook in HOOKS:
        return True
    try:
        method_config(method)
    except ValueError:
        return False
    return topology in HOOK_TOPOLOGIES


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """``"a/b,c/d"`` as [(a, b), (c, d)] (hook names, stripped)."""
    pairs = [tuple(h.strip() for h in item.split("/")) for item in text.split(",") if item.strip()]
    bad = [p for p in pairs if len(p) != 2 or not all(p)]
    if bad:
        raise SystemExit(f"dqsgd bench hook: --ratios wants 'hook/hook' pairs, got {bad}")
    return pairs  # type: ignore[return-value]


def bench_hook(args: argparse.Namespace) -> dict[str, Any]:
    from dqsgd.cli.launch import spawn_local

    models, hooks = args.model.split(","), ["none", *[h for h in args.hooks.split(",") if h and h != "none"]]
    pairs = parse_pairs(args.ratios)
    bad = ([m for m in models if m not in MODELS] + [h for h in hooks if not known_hook(h)]
           + [h for p in pairs for h in p if h not in hooks])
    if bad:
        raise SystemExit(f"dqsgd bench hook: unknown {bad}; models: {', '.join(MODELS)}; hooks: {', '.join(HOOKS)}, "
                         "or '<method> <sharded|allgather>' for any registered method; --ratios: hooks that run")
    cuda = torch.cuda.is_available()
    world, backend = (1, "nccl") if cuda else (args.world, "gloo")
    print(f"bench hook: {', '.join(models)} x {len(hooks)} hooks, {backend} W={world}, {args.rounds} rounds of "
          f"{args.steps} steps after {args.warmup} warm-up steps; load average {os.getloadavg()[0]:.2f}"
          + (f"; writes {args.out}" if args.out else ""),
          flush=True)
    res = spawn_local(rank_times, world, (models, hooks, args.steps, args.warmup, args.rounds, args.batch),
                      backend=backend, timeout=args.timeout, threads=args.threads, deadline=args.deadline)
    failed = [r.describe() for r in res if not r.ok]
    if failed:
        raise SystemExit("dqsgd bench hook: " + "; ".join(failed))
    result: dict[str, Any] = {"loadavg": os.getloadavg(), "device": "cuda" if cuda else "cpu", "world": world, "backend": backend,
                              "batch": args.batch, "steps": args.steps, "rounds": args.rounds, "models": {}}
    result["cpu"] = {}
    for name in models:
        for key, what in ((name, "step time"), (f"{name} cpu", "CPU time of rank 0's process per step")):
            rows = summarize(res[0].value[key], pairs)
            (result["models"] if key == name else result["cpu"])[name] = rows
            print(f"\n{name} ({sum(p.numel() for p in build(name).parameters()):,} parameters), {backend} W={world}, "
                  f"batch {args.batch}: {what} / no-hook's, median [min, max] over {args.rounds} rounds")
            for r in rows:
                ms = "" if math.isnan(r["ms"]) else f"{r['ms']:8.1f} ms"  # hook-to-hook ratio rows have no time
                print(f"  {r['hook']:28s} {ms:>11s}   {r['ratio']:.2f}  [{r['min']:.2f}, {r['max']:.2f}]")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"\nwrote {args.out}")
    return result
