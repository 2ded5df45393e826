"""Rank functions for the HSDP replicate-leg tests (run inside ``spawn_local`` processes).

Rank r is node r // S, position r % S of an R × S grid (R nodes of S ranks); the two-unit model of the
FSDP tests is sharded on the 2-D mesh ("2d": FSDP's own HSDP, its all-reduce emptied by dqsgd) or on
the mesh's shard dimension with the replicate dimension's group beside it ("1d").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dqsgd.fsdp as dfsdp
from _fsdp_ranks import _timed_error, batch, params
from dqsgd.ddp import HookState
from dqsgd.fsdp.hsdp import ReplicateLeg

SEED, STEPS, LR = 5, 3, 0.1


def grid(R: int, S: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))


def model(mesh: Any, kind: str) -> nn.Module:
    """Two units and the root ("2d", "1d"), or the root alone, reduced in FSDP's end-of-backward
    callback ("2d-root")."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(12, 37), nn.Tanh(), nn.Linear(37, 5))
    on = mesh if kind.startswith("2d") else mesh["shard"]
    if kind != "2d-root":
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=on)
    fully_shard(m, mesh=on)
    return m


class Recorder:
    """Every replicate-leg call: unit, its input (the reduce-scatter's output), its output, the widths
    the unit's hook bucket used (uplink, downlink), and whether the leg was left in flight to finish
    while the backward went on (its output then read after the backward: :meth:`settle`)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._orig = ReplicateLeg.__call__
        self._later: list[tuple[dict[str, Any], torch.Tensor]] = []
        rec = self

        def call(leg: ReplicateLeg, reduce_output: torch.Tensor) -> None:
            x = reduce_output.detach().clone()
            rec._orig(leg, reduce_output)
            b = leg.state._buckets.get(leg.index)
            later = leg.overlap is not None and leg.overlap.holds(leg)
            c = {"unit": leg.index, "input": x, "output": None if later else reduce_output.detach().clone(),
                 "pieces": leg.pieces, "bits": None if b is None else b.bits, "deferred": later}
            if later:
                rec._later.append((c, reduce_output.detach()))
            rec.calls.append(c)

        ReplicateLeg.__call__ = call  # type: ignore[method-assign]

    def settle(self) -> None:
        """After a backward: the outputs of the legs that finished at its end."""
        for c, out in self._later:
            c["output"] = out.clone()
        self._later = []

    def close(self) -> None:
        ReplicateLeg.__call__ = self._orig  # type: ignore[method-assign]


def train(m: nn.Module, rank: int, steps: range, rec: Recorder | None = None) -> None:
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    for s in steps:
        m(batch(rank, s)).square().mean().backward()
        if rec is not None:
            rec.settle()
        opt.step()
        opt.zero_grad()


def run(rank: int, R: int, S: int, kind: str, hook: dict | None, fsdp: dict | None = None,
        timeout: float = 60.0, factor: float | None = None, overlap: bool = True) -> dict[str, Any]:
    """STEPS SGD steps: ``hook`` None: FSDP's own HSDP (2-D mesh), else the replicate leg with
    HookState(**hook) (and FSDPState(**fsdp) on the intra-node legs when given); ``factor``: FSDP's
    gradient divide factor on every unit (with sum-only collectives: gloo has no PREMUL_SUM);
    ``overlap=False``: every replicate leg waits for its result (no leg left in flight)."""
    mesh = grid(R, S)
    m = model(mesh, kind)
    if factor is not None:
        for unit in (m[0], m[2], m) if kind != "2d-root" else (m,):
            unit.set_gradient_divide_factor(factor)
            unit.set_force_sum_reduction_for_comms(True)
    rep = state = None
    if hook is not None:
        rep = HookState(**{"seed": SEED, "timeout": timeout, "total_steps": STEPS, **hook},
                        process_group=mesh.get_group("replicate"))
    if fsdp is not None:
        state = dfsdp.FSDPState(**{"seed": SEED, "timeout": timeout, **fsdp})
    if rep is not None or state is not None:
        for comm in dfsdp.compress(m, state, replicate=rep):
            if isinstance(comm, ReplicateLeg) and not overlap:
                comm.overlap = None
    rec = Recorder()
    try:
        train(m, rank, range(STEPS), rec)
    finally:
        rec.close()
    return {"params": params(m), "calls": rec.calls, "stats": None if rep is None else rep.compression_stats(),
            "replica": dist.get_rank(mesh.get_group("replicate")), "state_replica": None if state is None else state.replica}


LOSSLESS = {"method": "sgd", "downlink_bits": "fp32", "min_compression_rate": 0.0}
Q4 = {"method": "qsgd-4bit"}
DQSGD = {"method": "dqsgd", "min_compression_rate": 0.0}


def cases(rank: int, world: int, R: int, S: int) -> dict[str, Any]:
    return {"native": run(rank, R, S, "2d", None),
            "lossless_2d": run(rank, R, S, "2d", LOSSLESS), "lossless_1d": run(rank, R, S, "1d", LOSSLESS),
            "q4_2d": run(rank, R, S, "2d", Q4), "q4_1d": run(rank, R, S, "1d", Q4),
            "q4_fp32down": run(rank, R, S, "1d", {**Q4, "downlink_bits": "fp32"}),
            "q4_2d_waiting": run(rank, R, S, "2d", Q4, overlap=False),
            "dqsgd_1d": run(rank, R, S, "1d", DQSGD), "dqsgd_1d_waiting": run(rank, R, S, "1d", DQSGD, overlap=False),
            "both": run(rank, R, S, "2d", Q4, {"method": "qsgd-4bit", "param_bits": 8}),
            "rs_lossless_2d": run(rank, R, S, "2d", None, {"method": "sgd", "min_compression_rate": 0.0}),
            "native_factor": run(rank, R, S, "2d", None, factor=3.0),
            "warmup": run(rank, R, S, "1d", {**Q4, "start_iter": STEPS}),
            "native_root": run(rank, R, S, "2d-root", None), "lossless_root": run(rank, R, S, "2d-root", LOSSLESS),
            "lossless_factor": run(rank, R, S, "2d", LOSSLESS, factor=3.0)}


def forged(rank: int, world: int, R: int, S: int, timeout: float) -> dict[str, tuple[str, float]]:
    """The last rank damages the messages it sends on the replicate leg (after a clean step, which
    compiles the codecs): a header byte, then a body byte of every message; each rank's error and
    the seconds until it was raised."""
    out = {}
    orig = dist.all_to_all_single
    for name, at in (("header", lambda n: 0), ("body", lambda n: n - 3)):
        mesh = grid(R, S)
        m = model(mesh, "2d")
        rep = HookState("qsgd-4bit", mesh.get_group("replicate"), SEED, timeout, STEPS)
        dfsdp.compress(m, None, replicate=rep)
        train(m, rank, range(1))

        def damaged(output, input, output_split_sizes=None, input_split_sizes=None, **kw):  # noqa: A002
            start = 0
            for n in input_split_sizes or []:
                if n > 1:
                    input[start + at(n)] ^= 0xFF
                start += n
            return orig(output, input, output_split_sizes, input_split_sizes, **kw)

        dist.all_to_all_single = damaged if rank == world - 1 else orig
        try:
            out[name] = _timed_error(lambda: train(m, rank, range(1, 2)))
        finally:
            dist.all_to_all_single = orig
    return out


def disagree(rank: int, world: int, R: int, S: int) -> dict[str, str]:
    """The last rank's replicate leg runs another method, then another seed; a 1-D shard mesh with
    the shard group itself passed as the replica group."""
    from _fsdp_ranks import _error

    out = {}
    for name, kw in (("method", {"method": "qsgd-8bit"}), ("seed", {"seed": SEED + 1})):
        mesh = grid(R, S)
        m = model(mesh, "2d")
        mine = {"method": "qsgd-4bit", "seed": SEED, **(kw if rank == world - 1 else {})}
        rep = HookState(**mine, process_group=mesh.get_group("replicate"), timeout=60)
        out[name] = _error(lambda: dfsdp.compress(m, None, replicate=rep))
    mesh = grid(R, S)
    m = model(mesh, "2d")  # dqsgd's reduce-scatter beside FSDP's own all-reduce: the FSDPStates compared too
    st = dfsdp.FSDPState("qsgd-4bit", seed=SEED + (rank == world - 1), timeout=60)
    out["fsdp_seed"] = _error(lambda: dfsdp.compress(m, st))
    mesh = grid(R, S)
    m = model(mesh, "1d")
    wrong = HookState("qsgd-4bit", mesh.get_group("shard"), timeout=60)
    out["group"] = _error(lambda: dfsdp.compress(m, None, replicate=wrong))
    return out


def failed_backward(rank: int, world: int, R: int, S: int, timeout: float) -> tuple[str, float]:
    """After a clean step, the last rank's backward fails (an error raised by a gradient hook between
    the two units) once the legs of unit 1 are in flight, and that rank then stays alive, silent, for
    4 × ``timeout`` before it leaves. This rank's error and the seconds until its backward raised."""
    import time

    mesh = grid(R, S)
    m = model(mesh, "2d")
    rep = HookState("qsgd-4bit", mesh.get_group("replicate"), SEED, timeout, STEPS)
    dfsdp.compress(m, None, replicate=rep)
    train(m, rank, range(1))

    def boom(grad: torch.Tensor) -> None:
        raise RuntimeError("injected failure")

    if rank == world - 1:  # unit 1's backward (its reduce-scatter and replicate leg) runs before this hook
        m[1].register_forward_pre_hook(lambda mod, args: args[0].register_hook(boom) and None)
    t0 = time.perf_counter()
    try:
        m(batch(rank, 1)).square().mean().backward()
        err = ""
    except Exception as e:  # noqa: BLE001 - the test reads the message
        err = f"{type(e).__name__}: {e}"
    elapsed = time.perf_counter() - t0
    if rank == world - 1:
        time.sleep(4 * timeout)
    return err, elapsed
