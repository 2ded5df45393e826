"""Rank functions for the quantized parameter all-gather tests (run inside ``spawn_local`` processes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dqsgd.fsdp as dfsdp
import dqsgd.fsdp.gather as gather
from _fsdp_ranks import _timed_error, batch, params

SEED, STEPS, LR = 5, 3, 0.1


def model(world: int, state: dfsdp.FSDPState | None, param_dtype: torch.dtype | None = None,
          gradients: bool = False) -> nn.Module:
    """The two-unit model of the FSDP tests (dim-0 padding at W = 2 and 4), optionally in mixed precision."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(12, 37), nn.Tanh(), nn.Linear(37, 5))
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(m, mesh=mesh, mp_policy=mp)
    if state is not None:
        dfsdp.compress(m, state, gradients=gradients)
    return m


COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "broadcast", "gather",
               "reduce_scatter_single", "barrier")


class Recorder:
    """Every parameter all-gather: unit, this rank's chunk as FSDP handed it (float32), the W
    dequantized chunks written to the output, the unit's sharded parameters before the call, and
    the torch.distributed collectives the call issued."""

    def __init__(self, m: nn.Module):
        self.calls: list[dict[str, Any]] = []
        self.step = 0
        self._orig = gather.DQSGDAllGather.__call__
        rec, model_ = self, m

        def call(comm, output_tensor, input_tensor, group, async_op=False):
            x = input_tensor.detach().float().clone()
            issued = []
            origs = {name: getattr(dist, name) for name in COLLECTIVES}

            def counted(name):
                def fn(*a, **kw):
                    issued.append(name)
                    return origs[name](*a, **kw)
                return fn

            for name in COLLECTIVES:
                setattr(dist, name, counted(name))
            try:
                work = rec._orig(comm, output_tensor, input_tensor, group, async_op)
            finally:
                for name, fn in origs.items():
                    setattr(dist, name, fn)
            rec.calls.append({"unit": comm.index, "step": rec.step, "input": x, "output": output_tensor.detach().float().clone(),
                              "dtype": str(output_tensor.dtype), "collectives": issued})
            return work

        gather.DQSGDAllGather.__call__ = call
        self.model = model_

    def close(self) -> None:
        gather.DQSGDAllGather.__call__ = self._orig


def train(m: nn.Module, rank: int, steps: range, rec: Recorder | None = None) -> list[dict[str, Any]]:
    """SGD steps; per step every parameter's sharded value before the step and its gradient."""
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    log = []
    for s in steps:
        if rec is not None:
            rec.step = s
        before = params(m)
        m(batch(rank, s)).float().square().mean().backward()
        log.append({"before": before, "grads": [p.grad.to_local().detach().clone() for p in m.parameters()]})
        opt.step()
        opt.zero_grad()
    return log


def run(rank: int, world: int, bits: int | None, rounding: str = "nearest",
        param_dtype: torch.dtype | None = None) -> dict[str, Any]:
    state = None if bits is None else dfsdp.FSDPState("sgd", seed=SEED, param_bits=bits, param_rounding=rounding,
                                                     param_block=16, timeout=60)
    m = model(world, state, param_dtype)
    rec = Recorder(m)
    try:
        log = train(m, rank, range(STEPS), rec)
    finally:
        rec.close()
    return {"params": params(m), "calls": rec.calls, "log": log, "dtypes": [str(p.dtype) for p in m.parameters()],
            "shapes": [tuple(p.shape) for p in m.parameters()],
            "stats": None if state is None else state.stats()}


def resumed(rank: int, world: int) -> dict[str, Any]:
    """The stochastic 8-bit run of :func:`run`, stopped after one step and resumed in a fresh model and
    state from the first's sharded parameters and ``state_dict`` (SGD without momentum has no state)."""
    def make() -> tuple[dfsdp.FSDPState, nn.Module]:
        st = dfsdp.FSDPState("sgd", seed=SEED, param_bits=8, param_rounding="stochastic", param_block=16, timeout=60)
        return st, model(world, st)

    first, m1 = make()
    train(m1, rank, range(1))
    saved = first.state_dict()
    second, m2 = make()
    with torch.no_grad():
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            p2.to_local().copy_(p1.to_local())
    second.load_state_dict(saved)
    train(m2, rank, range(1, STEPS))
    return {"params": params(m2), "saved": saved["gather_calls"]}


def cases(rank: int, world: int, extras: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"default": run(rank, world, None), "lossless": run(rank, world, 32),
                           "q8": run(rank, world, 8), "q4": run(rank, world, 4)}
    if extras:
        out["q8s"] = run(rank, world, 8, "stochastic")
        out["q8s_again"] = run(rank, world, 8, "stochastic")
        out["q8s_resumed"] = resumed(rank, world)
        out["bf16_default"] = run(rank, world, None, param_dtype=torch.bfloat16)
        out["bf16_lossless"] = run(rank, world, 32, param_dtype=torch.bfloat16)
        out["bf16_q8"] = run(rank, world, 8, param_dtype=torch.bfloat16)
    return out


def forged(rank: int, world: int, timeout: float) -> dict[str, tuple[str, float]]:
    """Rank W−1 forges its parameter payload (after one clean step, which compiles the codec's
    kernels): past its cap (its frame announces the length, the bytes past the cap cut); at 4 bits
    where 8 are agreed (a length under the cap that fails the width check); a flipped body byte; none
    at all (the empty payload of a shard holding NaN or Inf). Each rank's error and the seconds until
    it was raised."""
    state = dfsdp.FSDPState("sgd", seed=SEED, param_bits=8, timeout=timeout)
    train(model(world, state), rank, range(1))
    orig, out = gather.encode_shard, {}

    def flip(p: bytes) -> bytes:
        b = bytearray(p)
        b[len(b) - 6] ^= 0xFF
        return bytes(b)

    forgeries = {"oversize": lambda x, bits, *a: orig(x, bits, *a) + bytes(1 << 16),
                 "width": lambda x, bits, *a: orig(x, 4, *a),
                 "corrupt": lambda x, bits, *a: flip(orig(x, bits, *a)),
                 "nonfinite": lambda x, bits, *a: b""}
    for name, how in forgeries.items():
        gather.encode_shard = how if rank == world - 1 else orig
        try:
            st = dfsdp.FSDPState("sgd", seed=SEED, param_bits=8, timeout=timeout)
            out[name] = _timed_error(lambda: train(model(world, st), rank, range(1)))
        finally:
            gather.encode_shard = orig
    return out
