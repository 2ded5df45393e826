"""Rank functions of the engine's reliability tests: forged sizes and bytes, disagreeing ranks, overflow,
skipped steps, under the DDP hook and the parameter-server transport (2 gloo ranks)."""

from __future__ import annotations

import resource
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dqsgd.ddp
from dqsgd.topology import exchange
from dqsgd.method.config import method_config
from dqsgd.topology import payloads
from dqsgd.topology.bucket import BucketProtocol

N = 4000  # one bucket


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(N, 1, bias=False)


def _ddp(state: dqsgd.ddp.HookState) -> DDP:
    m = DDP(_model(), bucket_cap_mb=25)
    m.register_comm_hook(state, dqsgd.ddp.hook)
    return m


def _backward(m: DDP, rank: int, scale: float = 1.0, poison: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, N, generator=g) * scale
    if poison:
        x[0, 0] = float("inf")
    m.zero_grad()
    m(x).sum().backward()
    return m.module.weight.grad.detach().clone()


def _outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the type and the text
        return type(e).__name__, str(e)
    return "ok", ""


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def forged_announcement(rank: int, world: int, topology: str, size: int) -> dict[str, Any]:
    """D1: rank 1 announces a payload of ``size`` bytes (Elias coding: sizes are exchanged)."""
    cfg = method_config("qsgd", bits=4, coding="elias")
    state = dqsgd.ddp.HookState(cfg, None, timeout=30.0, topology=topology)
    m, real = _ddp(state), exchange.size_table
    if rank == 1:
        exchange.size_table = lambda group, mine, fixed, device: real(group, [size] * len(mine), fixed, device)  # type: ignore
    before = _rss_mb()
    kind, text = _outcome(lambda: _backward(m, rank))
    exchange.size_table = real
    return {"kind": kind, "text": text, "rss_growth_mb": _rss_mb() - before}


def forged_coded_downlink(rank: int, world: int) -> dict[str, Any]:
    """D19: rank 1, a shard server of a coded downlink, sends a message past its coding's cap (its length
    travels in the lengths' all-gather): every rank refuses it before the payloads' all-gather."""
    from dqsgd.topology.bucket import BucketProtocol

    state = dqsgd.ddp.HookState(method_config("qsgd", bits=4), None, timeout=30.0, downlink_coding="auto")
    m, real = _ddp(state), BucketProtocol.encode_down_fed
    if rank == 1:
        def forged(proto, shard, avg, step, residual, size=None, bad=None, dbits=None):  # type: ignore[no-untyped-def]
            cap = proto.down_caps(dbits)[shard]
            return torch.zeros(cap + 1000, dtype=torch.uint8), None
        BucketProtocol.encode_down_fed = forged  # type: ignore[method-assign]
    kind, text = _outcome(lambda: _backward(m, rank))
    BucketProtocol.encode_down_fed = real  # type: ignore[method-assign]
    return {"kind": kind, "text": text}


def flipped_byte(rank: int, world: int, topology: str, coding: str,
                 state: dqsgd.ddp.HookState | None = None) -> dict[str, Any]:
    """D13: rank 1 flips one byte of its payload for shard 0 (fixed: the in-place path; elias: encode)."""
    if state is None:
        state = dqsgd.ddp.HookState(method_config("qsgd", bits=4, coding=coding), None, timeout=30.0,
                                    topology=topology)
    m = _ddp(state)
    real_messages, real_encode = payloads.encode_messages, BucketProtocol.encode
    if rank == 1:
        def messages(*a: Any) -> Any:
            got = real_messages(*a)
            if got is not None:
                got[0][40] ^= 0x10
            return got

        def encode(self: BucketProtocol, *a: Any, **kw: Any) -> Any:
            out, res = real_encode(self, *a, **kw)
            out[0] = out[0].clone()
            out[0][40] ^= 0x10
            return out, res

        payloads.encode_messages, BucketProtocol.encode = messages, encode  # type: ignore[assignment]
    kind, text = _outcome(lambda: _backward(m, rank))
    payloads.encode_messages, BucketProtocol.encode = real_messages, real_encode  # type: ignore[method-assign]
    return {"kind": kind, "text": text}


def disagreeing(rank: int, world: int, field: str) -> dict[str, Any]:
    """D2/D5/D7: rank 1's hook differs from rank 0's in one field."""
    kw: dict[str, Any] = {"method": method_config("qsgd", bits=4), "topology": "sharded", "downlink_bits": 8,
                          "start_iter": 0}
    other = {"bits": {"method": method_config("qsgd", bits=8)},
             "topology": {"topology": "allgather"},
             "method": {"method": method_config("sgd")},
             "coding": {"method": method_config("qsgd", bits=4, coding="elias")},
             "start_iter": {"start_iter": 1},
             "downlink_bits": {"downlink_bits": 4}}[field]
    if rank == 1:
        kw.update(other)
    state = dqsgd.ddp.HookState(kw.pop("method"), None, timeout=30.0, **kw)
    m = _ddp(state)
    kind, text = _outcome(lambda: _backward(m, rank))
    return {"kind": kind, "text": text}


def overflow_safe_mean(rank: int, world: int, topology: str) -> dict[str, Any]:
    """D10: every rank's gradient is 2e38 everywhere (qsgd 8-bit): the mean is 2e38, not inf."""
    state = dqsgd.ddp.HookState(method_config("qsgd", bits=8), None, timeout=30.0, topology=topology)
    m = DDP(_model(), bucket_cap_mb=25)
    m.register_comm_hook(state, dqsgd.ddp.hook)
    m.zero_grad()
    m(torch.full((1, N), 2e38)).sum().backward()  # d/dw of w·x is x = 2e38 (the output overflows; no matter)
    return {"grad": m.module.weight.grad.detach().clone()}


def skipped_step_keeps_state(rank: int, world: int, topology: str) -> dict[str, Any]:
    """D18: ef-signsgd; a step where rank 1 overflows (GradScaler skips it) changes no residual."""
    state = dqsgd.ddp.HookState("ef-signsgd", None, timeout=30.0, topology=topology)
    m = _ddp(state)
    _backward(m, rank)
    before = {j: r.clone() for j, r in state._buckets[0].residuals.items()}
    grad = _backward(m, rank, poison=rank == 1)
    after = state._buckets[0].residuals
    same = before.keys() == after.keys() and all(torch.equal(before[j], after[j]) for j in before)
    return {"nan": bool(torch.isnan(grad).all()), "same": same, "had": bool(before)}


def after_a_failed_backward(rank: int, world: int) -> dict[str, Any]:
    """D20: a backward that raises (a gradient hook of the input, run after the hook has sent the
    bucket) on every rank; then the same HookState on a new DDP of the model, where rank 1 flips a byte
    of its payload: the refusal must still reach backward()'s caller on every rank."""
    state = dqsgd.ddp.HookState(method_config("qsgd", bits=4), None, timeout=30.0)
    m = _ddp(state)
    _backward(m, rank)

    def boom(grad: torch.Tensor) -> None:
        raise RuntimeError("injected failure")

    x = torch.randn(8, N, requires_grad=True) * 1.0  # its gradient comes after the weight's (the bucket's)
    x.register_hook(boom)
    failed = _outcome(lambda: m(x).sum().backward())
    return {"failed": failed, **flipped_byte(rank, world, "sharded", "fixed", state)}


def all_cases(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for topology in ("sharded", "allgather"):
        for size in (400 << 20, 1 << 40):
            out[f"D1/{topology}/{size}"] = forged_announcement(rank, world, topology, size)
        for coding in ("fixed", "elias"):
            out[f"D13/{topology}/{coding}"] = flipped_byte(rank, world, topology, coding)
        out[f"D10/{topology}"] = overflow_safe_mean(rank, world, topology)
        out[f"D18/{topology}"] = skipped_step_keeps_state(rank, world, topology)
    for field in ("bits", "topology", "method", "coding", "start_iter", "downlink_bits"):
        out[f"D2/{field}"] = disagreeing(rank, world, field)
    out["D19"] = forged_coded_downlink(rank, world)
    out["D20"] = after_a_failed_backward(rank, world)
    return out
