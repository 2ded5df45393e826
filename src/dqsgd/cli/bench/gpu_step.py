"""``dqsgd bench gpu``'s step section: the DDP step of every hook a user weighs, the bytes each sends,
and the step modelled over a shaped inter-node link.

* :func:`step_times` — loopback DDP step time (one process, world size 1) of no hook, PyTorch's
  fp16 and bf16 compression hooks, PowerSGD ranks 1 and 4, and the loopback of dqsgd's qsgd-4bit and
  dqsgd hooks (:class:`dqsgd.cli.bench.loopback.LoopbackHook`: the codec work of one of W ranks), in
  interleaved rounds, as a ratio to no hook in the same round;
* :func:`wire_bytes` — the bytes one rank sends per step with each hook at world size W (below);
* :func:`link_rows` — each hook's step modelled on a link of 10, 25 and 100 Gbit/s:
  ``bytes·8 / rate + measured step`` (the measured loopback step holds the compute and the codec; the
  link adds the transfer, no overlap with the backward pass assumed: an upper bound).

Bytes one rank sends per step (``n`` parameters, tensors of the model's shapes, W ranks):

* no hook: a ring all-reduce of fp32, ``2·(W−1)/W · 4n``; fp16/bf16 hooks: ``2·(W−1)/W · 2n``;
* PowerSGD rank r: the ring all-reduce of fp32 P and Q factors (``(rows + cols)·r`` per tensor seen as
  rows × cols, where PyTorch's hook compresses it: ``2·(rows + cols)·r < rows·cols``, its default
  ``min_compression_rate``) and of every other tensor uncompressed;
* qsgd-4bit and dqsgd (sharded topology, one bucket of all n): the uplink sends the W−1 shard
  messages that other ranks serve (payload + flag byte, ``(W−1)/W`` of all W on average), the
  downlink's all-gather sends its own shard's 8-bit message to the W−1 others; dqsgd at the width it
  starts at (its policy's later widths are not recorded by the loopback).
"""

from __future__ import annotations

import copy
import statistics
import tempfile
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HOOKS", "RATES_GBIT", "host_times", "link_rows", "register", "step_times", "wire_bytes"]

HOOKS = ("none", "fp16", "bf16", "powersgd-1", "powersgd-4", "qsgd-4bit", "dqsgd")
RATES_GBIT = (10.0, 25.0, 100.0)


def register(model: Any, hook: str, world: int, total_steps: int) -> Any:
    """Register ``hook`` on the DDP ``model``: PyTorch's own hooks, or the loopback of a dqsgd method
    (returned, for its deferred checks)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from dqsgd.cli.bench.loopback import LoopbackHook, loopback_hook

    if hook in ("fp16", "bf16"):
        model.register_comm_hook(None, getattr(default_hooks, f"{hook}_compress_hook"))
    elif hook.startswith("powersgd-"):
        st = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=int(hook.split("-")[1]),
                                         start_powerSGD_iter=2)
        model.register_comm_hook(st, powerSGD_hook.powerSGD_hook)
    elif hook != "none":
        loop = LoopbackHook(hook, world, total_steps)
        model.register_comm_hook(loop, loopback_hook)
        return loop
    return None


def _ring(world: int, nbytes: float) -> float:
    return 2 * (world - 1) / world * nbytes


def wire_bytes(shapes: list[tuple[int, ...]], hook: str, world: int) -> float:
    """Bytes one rank sends per step with ``hook`` for parameters of ``shapes`` (module docstring)."""
    n = sum(int(torch.Size(s).numel()) for s in shapes)
    if hook == "none":
        return _ring(world, 4 * n)
    if hook in ("fp16", "bf16"):
        return _ring(world, 2 * n)
    if hook.startswith("powersgd-"):
        rank, els = int(hook.split("-")[1]), 0
        for s in shapes:
            rows = s[0] if s else 1
            cols = int(torch.Size(s).numel()) // max(rows, 1)
            small = (rows + cols) * min(rows, cols, rank)  # PyTorch's rule: compressed where 2·that < rows·cols
            els += small if 2 * small < rows * cols else rows * cols
        return _ring(world, 4 * els)
    from dqsgd.method.config import method_config
    from dqsgd.topology.bucket import BucketProtocol
    from dqsgd.topology.registry import SHARDED

    proto = BucketProtocol(method_config(hook), n, [int(torch.Size(s).numel()) for s in shapes],
                           topology=SHARDED.name, workers=world, seed=0, total_steps=10, downlink_bits=8)
    up = sum(m.message_bits(proto.method.config.bits) // 8 + 1 for m in proto.shards)
    return (world - 1) / world * up + (world - 1) * (max(proto.down_sizes()) + 1)


def link_rows(rows: list[dict[str, Any]], rates: tuple[float, ...] = RATES_GBIT) -> list[dict[str, Any]]:
    """Per step row (model, world, hook, ms, bytes): ``ms_<rate>g = ms + bytes·8 / (rate·10⁹)·10³`` for each
    rate, and ``vs_none_<rate>g``: that time over no hook's at the same rate, model and W."""
    out = []
    for r in rows:
        row = {k: r[k] for k in ("model", "world", "hook", "bytes")}
        for g in rates:
            row[f"ms_{g:g}g"] = r["ms"] + r["bytes"] * 8 / (g * 1e9) * 1e3
        out.append(row)
    for row in out:
        base = next(b for b in out if (b["model"], b["world"], b["hook"]) == (row["model"], row["world"], "none"))
        for g in rates:
            row[f"vs_none_{g:g}g"] = row[f"ms_{g:g}g"] / base[f"ms_{g:g}g"]
    return out


def _train_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor | None) -> Any:
    """One SGD step of ``model`` on (x, y): cross-entropy for a classifier, else the mean square output."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)

    def run() -> None:
        opt.zero_grad()
        out = model(x)
        (torch.nn.functional.cross_entropy(out, y) if y is not None else out.float().pow(2).mean()).backward()
        opt.step()

    return run


def _timed(steppers: dict[str, Any], loops: dict[str, Any], device: torch.device, rounds: int,
           steps: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds per step of every hook, one entry per interleaved round, and each one's peak MiB (CUDA);
    a loopback's deferred payload checks are read after each of its rounds."""
    import time

    cuda = device.type == "cuda"
    times: dict[str, list[float]] = {h: [] for h in steppers}
    peak = {h: 0.0 for h in steppers}
    for _ in range(rounds):
        for h, step in steppers.items():
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            for _ in range(steps):
                step()
            if cuda:
                torch.cuda.synchronize()
                peak[h] = max(peak[h], torch.cuda.max_memory_allocated(device) / 2**20)
            times[h].append((time.perf_counter() - t) / steps)
            if loops[h] is not None:
                loops[h].check()
    return times, peak


def step_times(device: torch.device, models: list[str], worlds: list[int], rounds: int, steps: int, batch: int,
               hooks: tuple[str, ...] = HOOKS, warmup: int = 3) -> dict[str, Any]:
    """Loopback DDP step of each hook per model and W (median over interleaved rounds, ratio to no hook
    in the same round), the bytes each sends, and the kernel variants compiled during the timed rounds
    (:func:`dqsgd.kernels.device_common.compiled_variants`: Triton's and torch.compile's; None where
    nothing is compiled to count, Triton's interpreter)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dqsgd.cli.bench.loopback import build_model
    from dqsgd.kernels.device_common import compiled_variants

    skipped = {}
    if device.type != "cuda" and "bf16" in hooks:  # PyTorch's bf16 hook refuses anything but NCCL (or XCCL)
        hooks, skipped = tuple(h for h in hooks if h != "bf16"), {"bf16": "PyTorch's bf16 hook runs on NCCL only"}
    own = not dist.is_initialized()
    if own:
        store = dist.FileStore(tempfile.mktemp(prefix="dqsgd-bench-gpu-"), 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    rows: list[dict[str, Any]] = []
    recompiled: dict[str, int | None] = {}
    try:
        for name in models:
            net, shape, classify = build_model(name)
            shapes = [tuple(p.shape) for p in net.parameters()]
            g = torch.Generator().manual_seed(0)
            x = torch.randn(batch if classify else max(1, batch // 8), *shape, generator=g).to(device)
            y = torch.randint(0, 10, (batch,), generator=g).to(device) if classify else None
            for world in worlds:
                steppers, loops = {}, {}
                for h in hooks:
                    model = DDP(copy.deepcopy(net).to(device), device_ids=[device.index] if device.type == "cuda"
                                else None)
                    loops[h] = register(model, h, world, warmup + rounds * steps + 1)
                    steppers[h] = _train_step(model, x, y)
                    for _ in range(warmup):
                        steppers[h]()
                before = compiled_variants()
                times, peak = _timed(steppers, loops, device, rounds, steps)
                after = compiled_variants()
                for k, v in after.items():
                    was = recompiled.get(k, 0)
                    recompiled[k] = None if v is None or was is None else was + v - before[k]
                for h, ts in times.items():
                    r = [t / b for t, b in zip(ts, times["none"])]
                    rows.append({"model": name, "world": world, "hook": h, "ms": 1e3 * statistics.median(ts),
                                 "ratio": statistics.median(r), "min": min(r), "max": max(r),
                                 "bytes": wire_bytes(shapes, h, world),
                                 "peak_mb_over_none": peak[h] - peak["none"] if device.type == "cuda" else None})
    finally:
        if own:
            dist.destroy_process_group()
    return {"rows": rows, "link": link_rows(rows), "recompilations": recompiled, "skipped": skipped, "batch": batch,
            "rounds": rounds, "steps": steps}


def host_times(device: torch.device, worlds: list[int], numel: int, rounds: int,
               method: str = "qsgd-4bit") -> list[dict[str, Any]]:
    """Host time of one bucket's exchange per rank: the sharded exchange (:mod:`dqsgd.topology.exchange`,
    both legs, every shard) of W ranks of one in-process group on ``device``, timed without a
    synchronize (what the host spends issuing it) and divided by W; ``wall_us``: the same with a
    synchronize after it (not divided). Medians over ``rounds`` after one warm-up. On the CPU the
    codec's work runs on the host: a CPU figure is the code path's, never a GPU host time."""
    import time

    from dqsgd.method.config import method_config
    from dqsgd.topology.bucket import BucketProtocol
    from dqsgd.topology.registry import SHARDED
    from dqsgd.topology.exchange import in_process

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cfg = method_config(method)
    rows = []
    for world in worlds:
        proto = BucketProtocol(cfg, numel, [numel], topology=SHARDED.name, workers=world, seed=0,
                               total_steps=rounds + 2, downlink_bits=8)
        g = torch.Generator().manual_seed(world)
        flats = [torch.randn(numel, generator=g).to(device) for _ in range(world)]
        host, wall = [], []
        for step in range(rounds + 1):
            sync()
            t = time.perf_counter()
            in_process(proto, flats, cfg.bits, step)
            h = time.perf_counter() - t
            sync()
            if step:
                host.append(h)
                wall.append(time.perf_counter() - t)
        rows.append({"method": method, "world": world, "numel": numel,
                     "host_us_per_rank": 1e6 * statistics.median(host) / world,
                     "wall_us": 1e6 * statistics.median(wall)})
    return rows
