"""Rank functions of test_state_agreement.py (issue 40, causes 1 and 5): run inside ``spawn_local`` processes."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.topology.agreement import RankDisagreement, agree
from dqsgd.train.config import ExperimentConfig, MethodEntry
from dqsgd.train.runner import run_one
from dqsgd.transport.torch_dist import make_transport


def _error(fn: Any) -> str | None:
    try:
        fn()
    except RankDisagreement as e:
        return str(e)
    return None


def local_rounds(rank: int, world: int) -> dict[str, Any]:
    """E2: rank 0 continues from its state after 4 steps (round 1), rank 1 from its state after 8 (round 2)."""
    from _ranks_local import make, train

    model, opt = make(rank, 4, "qsgd-4bit", 8)
    saved = {}
    for stop in (4, 8):
        train(rank, model, opt, stop - 4, stop)
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        saved[stop] = buf.getvalue()
    model, opt = make(rank, 4, "qsgd-4bit", 8)
    opt.load_state_dict(torch.load(io.BytesIO(saved[4 if rank == 0 else 8]), weights_only=True))
    start = 4 if rank == 0 else 8
    return {"error": _error(lambda: train(rank, model, opt, start, start + 4)), "rounds": opt.rounds_done}


def local_init(rank: int, world: int, method: str) -> dict[str, Any]:
    """E3: every rank builds its model under its own seed (a user who forgot to seed alike)."""
    from _ranks_local import make, train

    model, opt = make(rank, 2, method, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * rank)  # rank 1's initial parameters differ from rank 0's
        opt.start = opt._flat()
    return {"error": _error(lambda: train(rank, model, opt, 0, 4))}


def checkpoint_every(rank: int, world: int, out: str) -> dict[str, Any]:
    """E7: rank 0 checkpoints every 4 steps, rank 1 every 6."""
    from _ranks_reliab import cfg

    t = make_transport("ps")
    entry = MethodEntry("qsgd", method_config("qsgd"))
    with t.guard():
        return {"error": _error(lambda: run_one(cfg(steps=6, checkpoint_every=4 if rank == 0 else 6), entry,
                                                load_dataset("synthetic"), 0, Path(out), transport=t, progress=False))}


def sweep_fields(rank: int, world: int) -> dict[str, Any]:
    """L1: for each field of a hook's configuration, rank 1 alone changes it; every message must name it alone."""
    from dqsgd.ddp import HookState

    fields = HookState("dqsgd", total_steps=100).fields()
    t = make_transport("ps")
    named = {}
    with t.guard():
        for key in sorted(fields):
            mine = {**fields, key: "changed"} if rank == 1 else dict(fields)
            named[key] = _error(lambda: agree(mine, t.all_gather_ints, rank))
    return {"named": named}


def fsdp_shapes(rank: int, world: int) -> dict[str, Any]:
    """L12: rank 1's first unit has 38 output features, rank 0's 37: refused by compress, naming the unit."""
    import dqsgd.fsdp as dfsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    width = 37 + rank
    m = nn.Sequential(nn.Linear(12, width), nn.Tanh(), nn.Linear(width, 5))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)

    def run() -> None:
        dfsdp.compress(m, dfsdp.FSDPState("qsgd-4bit", timeout=20))
        m(torch.randn(4, 12)).square().mean().backward()

    return {"error": _error(run)}


def backup_timeout(rank: int, world: int, exp: ExperimentConfig) -> dict[str, Any]:
    """M6: the backup workers' transport of a `dqsgd train --timeout 5` rank waits 5 s for a silent worker."""
    from dqsgd.cli.launch import _RankJob, job_transport

    job = _RankJob(exp, exp.methods[0], 0, "ps", None, False, timeout=5.0)
    t = job_transport(dataclasses.replace(job), "cpu")
    return {"wait_s": t.wait_s, "backup": t.backup}


def local_malformed(rank: int, world: int) -> dict[str, Any]:
    """L10: malformed and wrong-shaped Local SGD states are refused before anything is loaded."""
    from _ranks_local import make, train

    model, opt = make(rank, 2, "qsgd-4bit", 4)
    train(rank, model, opt, 0, 2)
    good = opt.state_dict()
    model, fresh = make(rank, 2, "qsgd-4bit", 4)
    before = (repr(fresh.optimizer.state_dict()), fresh._flat().clone())
    errors = []
    broken = [{k: v for k, v in good.items() if k != "outer"}, {**good, "steps": "two"},
              {**good, "params": torch.zeros(3)}, {**good, "start": torch.zeros(5, 5)}]
    for state in broken:
        try:
            fresh.load_state_dict(state)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    unchanged = repr(fresh.optimizer.state_dict()) == before[0] and torch.equal(fresh._flat(), before[1])
    return {"errors": errors, "unchanged": unchanged}


def local_malformed_fed(rank: int, world: int, fragments: int) -> dict[str, Any]:
    """L10: forged error-fed downlink residuals (a wrong length, NaN, another shard's index, not a tensor) are
    refused before anything is loaded, unfragmented and in a streaming fragment's state."""
    from _ranks_local import make, train

    kw = {"downlink_bits": 3, "downlink_feedback": True, "fragments": fragments}
    model, opt = make(rank, 4, "qsgd-4bit", 4, **kw)
    train(rank, model, opt, 0, 9)  # two exchanges: every fragment's residual is non-zero
    good = opt.state_dict()
    model, fresh = make(rank, 4, "qsgd-4bit", 4, **kw)
    before = (repr(fresh.optimizer.state_dict()), fresh._flat().clone())

    def forged(fed: Any) -> dict[str, Any]:
        if fragments == 1:
            return {**good, "down_residuals": fed}
        frags = [dict(f) for f in good["streaming"]["frags"]]
        frags[0] = {**frags[0], "state": {**frags[0]["state"], "down": fed}}
        return {**good, "streaming": {**good["streaming"], "frags": frags}}

    held = good["down_residuals"] if fragments == 1 else good["streaming"]["frags"][0]["state"]["down"]
    (j, r), = held.items()
    errors = []
    for fed in ({j: r[:-1]}, {j: torch.full_like(r, float("nan"))}, {world + 3: r}, {j: r.tolist()}):
        try:
            fresh.load_state_dict(forged(fed))
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    unchanged = repr(fresh.optimizer.state_dict()) == before[0] and torch.equal(fresh._flat(), before[1])
    fresh.load_state_dict(good)  # the good state still loads
    return {"errors": errors, "unchanged": unchanged, "shard": j, "nonzero": float(r.abs().max()) > 0}


def hook_progress(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's hook state was loaded from a later step than rank 0's: refused at the first backward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dqsgd.ddp import HookState, hook

    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 8))
    state = HookState("qsgd-4bit", timeout=20)
    saved = HookState("qsgd-4bit").state_dict()
    saved["iter"] = 3 * rank
    state.load_state_dict(saved)
    model.register_comm_hook(state, hook)
    return {"error": _error(lambda: model(torch.randn(4, 64)).sum().backward())}
