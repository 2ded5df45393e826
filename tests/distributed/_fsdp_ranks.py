"""Rank functions for the FSDP2 compressor tests (run inside ``spawn_local`` processes)."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dqsgd.fsdp as dfsdp
from dqsgd.topology.exchange import Exchange

SEED, STEPS, CODED_STEPS = 5, 3, 40


def model(world: int, compress: dfsdp.FSDPState | None) -> nn.Module:
    """Two FSDP units with dim-0 padding at W = 2 and 4 (37 and 5 rows), and the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(12, 37), nn.Tanh(), nn.Linear(37, 5))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    if compress is not None:
        dfsdp.compress(m, compress)
    return m


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(16, 12, generator=torch.Generator().manual_seed(1000 * step + rank))


def train(m: nn.Module, rank: int, steps: range) -> None:
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for s in steps:
        m(batch(rank, s)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def params(m: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in m.parameters()]


class Recorder:
    """Every call of the compressor: unit, width used, input, output, and the bytes handed to the
    process group (all_to_all_single, all_gather, all_reduce, reduce_scatter_single) during it; per
    unit the spent bits of each compressed step that no rank overflowed (the policy's, from the
    exchange's size table)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.calls, self.active, self.handed = rank, world, [], False, 0
        self.spent: dict[int, list[int]] = {}
        self._orig, start = dfsdp.DQSGDReduceScatter.__call__, Exchange.start
        rec, started = self, []

        def record(ex, ranks):
            futures = start(ex, ranks)
            started.extend(futures.values())
            return futures

        def call(comm, output_tensor, input_tensor, group, op, async_op=False):
            u = comm.state.units.get(comm.index)
            bits = None if u is None else u.bits
            before = comm.state.compression_stats().bytes_sent
            x = input_tensor.clone()
            rec.active, rec.handed = True, 0
            started.clear()
            try:
                out = rec._orig(comm, output_tensor, input_tensor, group, op, async_op)
            finally:
                rec.active = False
            for f in started:
                o = f.value()
                if not bool(o.bad):
                    rec.spent.setdefault(comm.index, []).append(comm.state.units[comm.index].proto.spent_bits(o.table))
            rec.calls.append({"unit": comm.index, "bits": bits, "input": x, "output": output_tensor.clone(),
                              "handed": rec.handed, "counted": comm.state.compression_stats().bytes_sent - before})
            return out

        self._patches = [(dfsdp.DQSGDReduceScatter, "__call__", call), (Exchange, "start", record)]
        for name, fn in (("all_to_all_single", self._a2a), ("all_gather", self._ag), ("all_reduce", self._ar),
                         ("reduce_scatter_single", self._rs)):
            self._patches.append((dist, name, self._wrap(getattr(dist, name), fn)))

    def _wrap(self, orig: Any, count: Any) -> Any:
        def wrapped(*args: Any, **kw: Any) -> Any:
            if self.active:
                self.handed += count(*args, **kw)
            return orig(*args, **kw)

        return wrapped

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Any = None, in_splits: Any = None, **kw: Any) -> int:
        return (sum(in_splits) - in_splits[self.rank]) * inp.element_size()

    def _ag(self, outs: list, t: torch.Tensor, **kw: Any) -> int:
        return (self.world - 1) * t.numel() * t.element_size()

    def _ar(self, t: torch.Tensor, **kw: Any) -> int:
        return 2 * (self.world - 1) * t.numel() * t.element_size() // self.world

    def _rs(self, **kw: Any) -> int:
        return (self.world - 1) * kw["input"].numel() * kw["input"].element_size() // self.world

    def __enter__(self) -> "Recorder":
        self._saved = [(obj, name, getattr(obj, name)) for obj, name, _ in self._patches]
        for obj, name, fn in self._patches:
            setattr(obj, name, fn)
        return self

    def __exit__(self, *exc: Any) -> None:
        for obj, name, fn in self._saved:
            setattr(obj, name, fn)


def run_case(rank: int, world: int, method: str, kw: dict) -> dict[str, Any]:
    state = dfsdp.FSDPState(method, seed=SEED, total_steps=STEPS, timeout=30, **kw)
    m = model(world, state)
    with Recorder(rank, world) as rec:
        train(m, rank, range(STEPS))
    return {"calls": rec.calls, "params": params(m), "spent": rec.spent,
            "budget": {i: u.method.budget_bits() for i, u in state.units.items()},
            "pieces": {c.index: c.pieces for c in _comms(m)}, "stats": state.compression_stats()}


def _comms(m: nn.Module) -> list:
    out = []
    for mod in m.modules():
        for g in getattr(mod._get_fsdp_state(), "_fsdp_param_groups", []) if hasattr(mod, "_get_fsdp_state") else []:
            if isinstance(g._reduce_scatter_comm, dfsdp.DQSGDReduceScatter):
                out.append(g._reduce_scatter_comm)
    return out


def resume(rank: int, world: int, method: str) -> dict[str, Any]:
    """STEPS + 2 steps straight, against STEPS steps, save, a new model and state, load, 2 more."""
    straight = dfsdp.FSDPState(method, seed=SEED, total_steps=STEPS + 2, timeout=30)
    a = model(world, straight)
    train(a, rank, range(STEPS + 2))
    first = dfsdp.FSDPState(method, seed=SEED, total_steps=STEPS + 2, timeout=30)
    b = model(world, first)
    train(b, rank, range(STEPS))
    buf = io.BytesIO()
    torch.save({"dqsgd": first.state_dict(), "params": params(b)}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    second = dfsdp.FSDPState(method, seed=SEED, total_steps=STEPS + 2, timeout=30)
    c = model(world, second)
    with torch.no_grad():
        for p, v in zip(c.parameters(), saved["params"]):
            p.to_local().copy_(v)
    second.load_state_dict(saved["dqsgd"])
    train(c, rank, range(STEPS, STEPS + 2))
    return {"straight": params(a), "resumed": params(c)}


def refusals(rank: int, world: int) -> dict[str, str]:
    """Each rank's error for: ranks with different methods; a forged size (rank 1 announces a payload
    above the cap for rank 0, in the size table's all-gather); a corrupted payload (every rank damages
    its payload for the next rank, so every receiver refuses one)."""
    out = {}
    method = "qsgd-4bit" if rank == 0 else "qsgd-2bit"
    out["config"] = _error(lambda: train(model(world, dfsdp.FSDPState(method, seed=SEED, timeout=10)), rank, range(1)))
    gather = dist.all_gather

    def forged(outs, t, *a, **kw):
        if rank == 1 and t.dtype == torch.int64 and t.numel() == world:  # this rank's payload sizes
            t = t.clone()
            t[0] += 1 << 20
        return gather(outs, t, *a, **kw)

    dist.all_gather = forged
    try:  # ef-signsgd: error feedback, so the sizes are exchanged
        out["forged"] = _error(lambda: train(model(world, dfsdp.FSDPState("ef-signsgd", seed=SEED, timeout=10)),
                                             rank, range(1)))
    finally:
        dist.all_gather = gather
    out["corrupt"] = _damaged(rank, world, lambda r: (r + 1) % world, lambda n: n // 2, 10.0, range(1))[0]
    return out


def _damaged(rank: int, world: int, to: Any, at: Any, timeout: float, steps: range,
             ranks: Any = None) -> tuple[str, float]:
    """The error of training ``steps`` of qsgd-4bit while rank r (those in ``ranks``; all: None) flips
    byte ``at(n)`` of its n-byte message for rank ``to(r)`` in the gradient's all-to-all."""
    orig = dist.all_to_all_single
    m = model(world, dfsdp.FSDPState("qsgd-4bit", seed=SEED, timeout=timeout))

    def damaged(output, input, output_split_sizes=None, input_split_sizes=None, **kw):  # noqa: A002
        if (ranks is None or rank in ranks) and input_split_sizes:
            start = sum(input_split_sizes[:to(rank)])
            input = input.clone()  # noqa: A001
            input[start + at(input_split_sizes[to(rank)])] ^= 0xFF
        return orig(output, input, output_split_sizes, input_split_sizes, **kw)

    dist.all_to_all_single = damaged
    try:
        return _timed_error(lambda: train(m, rank, steps))
    finally:
        dist.all_to_all_single = orig


def lone_refusals(rank: int, world: int, timeout: float) -> dict[str, tuple[str, float]]:
    """Rank W−1 alone damages its payload for rank 0 (so rank 0 alone refuses it): a flipped byte in
    the body, then in the header. Each rank's error and the seconds until it was raised (after one
    clean step, which compiles the codec's kernels)."""
    train(model(world, dfsdp.FSDPState("qsgd-4bit", seed=SEED, timeout=timeout)), rank, range(1))
    return {name: _damaged(rank, world, lambda r: 0, at, timeout, range(2), [world - 1])
            for name, at in (("corrupt", lambda n: n // 2), ("header", lambda n: 0))}


def nonfinite(rank: int, world: int) -> dict[str, Any]:
    """ef-signsgd; at the second step rank W−1's batch holds a NaN: every rank's reduced gradient
    shards, and whether each unit's error-feedback residual kept its value."""
    state = dfsdp.FSDPState("ef-signsgd", seed=SEED, total_steps=STEPS, timeout=30)
    m = model(world, state)
    train(m, rank, range(1))
    before = {i: {j: r.clone() for j, r in u.residuals.items()} for i, u in state.units.items()}
    x = batch(rank, 1)
    if rank == world - 1:
        x[3, 5] = float("nan")
    m(x).square().mean().backward()
    grads = [p.grad.to_local().clone() for p in m.parameters()]
    kept = {i: bool(before[i]) and all(torch.equal(u.residuals[j], r) for j, r in before[i].items())
            for i, u in state.units.items()}
    return {"grads": grads, "kept": kept, "n": {i: u.step for i, u in state.units.items()}}


def _error(fn: Any) -> str:
    return _timed_error(fn)[0]


def _timed_error(fn: Any) -> tuple[str, float]:
    """Run ``fn``; its error (or "") and the seconds until it returned or raised — then one
    all-gather, so the ranks leave the case together."""
    import time

    t0 = time.perf_counter()
    try:
        fn()
        err = ""
    except Exception as e:  # noqa: BLE001 - the test reads the message
        err = f"{type(e).__name__}: {e}"
    elapsed = time.perf_counter() - t0
    flag = torch.tensor([1 if err else 0])
    dist.all_gather([torch.zeros_like(flag) for _ in range(dist.get_world_size())], flag)
    return err, elapsed


def cases(rank: int, world: int, spec: list[tuple[str, dict]], extras: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    default = model(world, None)
    train(default, rank, range(STEPS))
    out: dict[str, Any] = {"default": params(default), "runs": {}}
    for method, kw in spec:
        out["runs"][method] = run_case(rank, world, method, kw)
    if extras:
        out["resume"] = {m: resume(rank, world, m) for m in ("dqsgd", "ef-signsgd")}
        out["refusals"] = refusals(rank, world)
        out["coded_budget"] = coded_budget(rank, world, CODED_STEPS)
    return out


def coded_budget(rank: int, world: int, steps: int) -> dict[str, Any]:
    """dqsgd-coded over ``steps`` steps on a unit of 16 640 elements (and the root's 257): every
    unit's coded bits per rank, step by step, and its budget."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 1))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    state = dfsdp.FSDPState("dqsgd-coded", seed=SEED, total_steps=steps, timeout=30, min_numel=1000)
    dfsdp.compress(m, state)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    with Recorder(rank, world) as rec:
        for s in range(steps):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1000 * s + rank))
            (m(x) - x[:, :1]).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return {i: (rec.spent.get(i, []), u.method.budget_bits()) for i, u in state.units.items()}
