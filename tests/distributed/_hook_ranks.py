"""Rank functions for the DDP hook tests (run inside ``spawn_local`` processes; importable by name)."""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import dqsgd.ddp

STEPS = 4


def net() -> nn.Module:
    """32·127 + 127 + 127·10 + 10 = 5471 parameters: one bucket, 5471 = 3·1823 + 2 (not divisible by 3)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 127), nn.ReLU(), nn.Linear(127, 10))


def linear() -> nn.Module:
    """One parameter tensor (5472 elements): DDP's first-iteration bucket order equals the later one."""
    torch.manual_seed(0)
    return nn.Linear(32, 171, bias=False)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)


def recording(buckets: list) -> Any:
    """dqsgd.ddp.hook, keeping a copy of each bucket's local gradient and its parameter sizes."""

    def rec(state, bucket):  # no annotations: DDP compares them with its own at run time
        local = bucket.buffer().clone()
        fut = dqsgd.ddp.hook(state, bucket)
        buckets.append([bucket.index(), local, [p.numel() for p in bucket.parameters()], fut])
        return fut

    return rec


def ddp_model(state: dqsgd.ddp.HookState | None, buckets: list | None = None, model: nn.Module | None = None) -> DDP:
    m = DDP(copy.deepcopy(model if model is not None else net()), bucket_cap_mb=1)
    if state is not None:
        m.register_comm_hook(state, recording(buckets) if buckets is not None else dqsgd.ddp.hook)
    return m


def grads(model: nn.Module, rank: int, step: int, scale: float = 1.0) -> torch.Tensor:
    x, y = batch(rank, step)
    model.zero_grad()
    (scale * F.cross_entropy(model(x), y)).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def hooked_runs(rank: int, world: int, cases: list[tuple[str, dict]]) -> dict[str, Any]:
    """For each (method, HookState kwargs): STEPS backward passes; the local buckets, the averaged
    gradients, the widths after each step and the stats."""
    out: dict[str, Any] = {"plain": [grads(ddp_model(None), rank, s) for s in range(STEPS)]}
    for method, kw in cases:
        state = dqsgd.ddp.HookState(method, None, seed=3, timeout=30.0, total_steps=20, **kw)
        buckets: list = []
        model = ddp_model(state, buckets)
        runs, bits, down = [], [], []
        for s in range(STEPS):
            runs.append(grads(model, rank, s))
            bits.append(state.current_bits())
            down.append(state.current_downlink_bits())
        buckets = [(i, local, sizes, fut.value().clone()) for i, local, sizes, fut in buckets]
        out[f"{method}/{kw}"] = {"runs": runs, "bits": bits, "down": down, "stats": state.compression_stats(),
                                 "buckets": buckets}
    return out


def repeated(rank: int, world: int, method: str, reps: int) -> dict[str, Any]:
    """``reps`` backward passes of one batch through the hook (fresh randomness each step)."""
    state = dqsgd.ddp.HookState(method, None, seed=3, timeout=30.0)
    model = ddp_model(state)
    return {"runs": torch.stack([grads(model, rank, 0) for _ in range(reps)]),
            "local": grads(copy.deepcopy(net()), rank, 0), "plain": grads(ddp_model(None), rank, 0)}


def w3_cases(rank: int, world: int, cases: list[tuple[str, dict]], reps: int) -> dict[str, Any]:
    return {"runs": hooked_runs(rank, world, cases), "mc": repeated(rank, world, "qsgd-4bit", reps)}


def w2_cases(rank: int, world: int) -> dict[str, Any]:
    return {"amp": amp_overflow(rank, world, "qsgd-4bit", "sharded"), "amp-ag": amp_overflow(rank, world, "dqsgd", "allgather"),
            "resume": resume(rank, world, "dqsgd", 3, 7),
            "resume-fed": resume(rank, world, "qsgd-4bit", 3, 7, downlink_bits=2, downlink_feedback=True),
            "warmup": warmup(rank, world, "qsgd-4bit", 2),
            "zero": zero_bucket(rank, world, "signsgd", "sharded"), "zero-ag": zero_bucket(rank, world, "signsgd", "allgather")}


def zero_bucket(rank: int, world: int, method: str, topology: str) -> dict[str, Any]:
    """A loss scaled by 0 (every gradient exactly 0) through the hook."""
    state = dqsgd.ddp.HookState(method, None, seed=3, timeout=30.0, topology=topology)
    model = ddp_model(state)
    return {"zero": grads(model, rank, 0, scale=0.0), "after": grads(model, rank, 1)}


def amp_overflow(rank: int, world: int, method: str, topology: str) -> dict[str, Any]:
    """GradScaler with an Inf loss on rank 1 at step 0; a normal step 1."""
    state = dqsgd.ddp.HookState(method, None, seed=3, timeout=30.0, topology=topology)
    model = ddp_model(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    params, scales, grads_seen = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            x, y = batch(rank, step)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y) * (float("inf") if step == 0 and rank == 1 else 1.0)
            scaler.scale(loss).backward()
            grads_seen.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
            scaler.step(opt)
            scaler.update()
            params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
            scales.append(float(scaler.get_scale()))
    init = torch.cat([p.detach().reshape(-1) for p in net().parameters()])
    return {"params": params, "scales": scales, "grads": grads_seen, "init": init, "bits": state.current_bits(),
            "said": [str(w.message) for w in caught if "dqsgd hook" in str(w.message)]}


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for s in steps:
        opt.zero_grad()
        F.cross_entropy(model(batch(rank, s)[0]), batch(rank, s)[1]).backward()
        opt.step()


def resume(rank: int, world: int, method: str, k: int, n: int, **hook: Any) -> dict[str, Any]:
    """n steps uninterrupted, against k steps + torch.save(state) + a new HookState + n − k steps
    (``hook``: more HookState arguments)."""
    kw = dict(seed=3, timeout=30.0, total_steps=n, **hook)
    ref_state = dqsgd.ddp.HookState(method, None, **kw)
    ref = ddp_model(ref_state, model=linear())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _train(ref, ref_opt, rank, range(n))
    first = dqsgd.ddp.HookState(method, torch.distributed.group.WORLD, **kw)  # an explicit group: still picklable
    model = ddp_model(first, model=linear())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, opt, rank, range(k))
    buf = io.BytesIO()
    torch.save({"hook": first.state_dict(), "pickled": first, "model": model.module.state_dict(),
                "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    second = dqsgd.ddp.HookState(method, None, **kw)
    second.load_state_dict(ck["hook"])
    fresh = linear()
    fresh.load_state_dict(ck["model"])
    model2 = ddp_model(second, model=fresh)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    opt2.load_state_dict(ck["opt"])
    _train(model2, opt2, rank, range(k, n))
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    return {"ref": flat(ref), "resumed": flat(model2), "ref_state": ref_state.state_dict(),
            "resumed_state": second.state_dict(), "unpickled": ck["pickled"].state_dict(),
            "at_k": ck["hook"]}


def warmup(rank: int, world: int, method: str, start_iter: int) -> dict[str, Any]:
    state = dqsgd.ddp.HookState(method, None, seed=3, timeout=30.0, start_iter=start_iter)
    model = ddp_model(state)
    plain = ddp_model(None)
    runs, ref, stats = [], [], []
    for s in range(start_iter + 1):
        runs.append(grads(model, rank, s))
        ref.append(grads(plain, rank, s))
        stats.append(state.compression_stats())
    return {"runs": runs, "plain": ref, "stats": stats}


def single(rank: int, world: int, method: str) -> dict[str, Any]:
    state = dqsgd.ddp.HookState(method, None, seed=3, timeout=30.0)
    local = copy.deepcopy(net())
    return {"hooked": grads(ddp_model(state), rank, 0), "local": grads(local, rank, 0),
            "stats": state.compression_stats()}


def compiled(rank: int, world: int, backend: str) -> dict[str, Any]:
    """A torch.compile'd DDP model with the hook against the same model run eagerly with the hook."""
    import time

    out: dict[str, Any] = {}
    for name in ("eager", "compiled"):
        state = dqsgd.ddp.HookState("qsgd-4bit", None, seed=3, timeout=60.0)
        model = ddp_model(state)
        run = torch.compile(model, backend=backend) if name == "compiled" else model
        t = time.perf_counter()
        out[name] = [grads(run, rank, s) for s in range(3)]
        out[f"{name}_s"] = time.perf_counter() - t
        out[f"{name}_stats"] = state.compression_stats()
    return out


def device_path_runs(rank: int, world: int, cases: list[tuple[str, dict]]) -> dict[str, Any]:
    """The same cases through the numba kernels and through the torch-ops device codec (the GPU
    code path, forced on CPU)."""
    from dqsgd.topology import payloads as ddp_codec

    host = hooked_runs(rank, world, cases)
    ddp_codec.route_cpu_through_device_codec(True)
    try:
        device = hooked_runs(rank, world, cases)
    finally:
        ddp_codec.route_cpu_through_device_codec(False)
    return {"host": host, "device": device}
