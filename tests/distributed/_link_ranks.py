"""Rank functions for the link policy through the DDP hook (tests/distributed/test_ddp_link.py)."""

from __future__ import annotations

from typing import Any

import dqsgd.ddp
from dqsgd.method.config import method_config
from _hook_ranks import ddp_model, grads, linear

STEPS = 5


def link_run(rank: int, world: int, kw: dict[str, Any]) -> dict[str, Any]:
    """STEPS backward passes of a one-bucket model through the hook under ``dqsgd-link`` (HookState
    kwargs ``kw``, method options under "method"): per step the local bucket, the averaged one, the
    policy state after it and this rank's bytes sent in it."""
    kw = dict(kw)
    cfg = kw.pop("config", None) or method_config(kw.pop("name", "dqsgd-link"), **kw.pop("method", {}))
    state = dqsgd.ddp.HookState(cfg, None, seed=3, timeout=60.0, total_steps=20, **kw)
    buckets: list = []
    model = ddp_model(state, buckets, linear())
    out: dict[str, Any] = {"policy": [], "sent": [], "bits": []}
    for s in range(STEPS):
        before = state.bytes_sent
        grads(model, rank, s)
        out["sent"].append(state.bytes_sent - before)
        out["bits"].append(state.current_bits())
        out["policy"].append(state._buckets[0].policy)
    out["buckets"] = [(i, local, sizes, fut.value().clone()) for i, local, sizes, fut in buckets]
    out["config"], out["link"] = state.config, state.link
    policy = state._buckets[0].proto.policy
    out["priced_mbit"], out["priced_codec"] = getattr(policy, "mbit", None), getattr(policy, "codec_ns", None)
    out["config_mbit"] = state._buckets[0].proto.method.config.link_mbit
    out["priced_steps"] = (getattr(policy, "step_ns", None), getattr(policy, "plain_ns", None))
    return out


def trainer_run(rank: int, world: int) -> dict[str, Any]:
    """``dqsgd train --transport torch`` on topology sharded, as each rank runs it: the widths of its
    steps and the policy state at the end."""
    from _engine_ranks import run_trainer
    from dqsgd.transport import make_transport

    tr, ledger = run_trainer("dqsgd-link", "sharded", make_transport("sharded", timeout=60.0), world)
    return {"bits": [r.bits for r in ledger.records], "policy": repr(tr.state.policy)}


def measured_trainer(rank: int, world: int) -> dict[str, Any]:
    """``dqsgd train --transport torch`` on sharded with ``dqsgd-link`` at ``link_mbit`` 0: the link_mbit its
    entry (the run's record) states and the one its method runs (the measured link), after one step."""
    import _engine_ranks as er
    from dqsgd.data import load_dataset
    from dqsgd.train.config import MethodEntry
    from dqsgd.train.trainer import Trainer
    from dqsgd.transport import make_transport

    entry = MethodEntry("dqsgd-link", method_config("dqsgd-link", link_mbit=0.0))
    tr = Trainer(er.train_config("sharded", world), entry, load_dataset("synthetic"), er.SEED,
                 make_transport("sharded", timeout=60.0))
    tr.step()
    return {"entry_mbit": tr.entry.config.link_mbit, "mbit": tr.method.config.link_mbit,
            "latency_ms": tr.method.config.link_latency_ms}


def link_cases(rank: int, world: int, cases: dict[str, dict[str, Any]],
               others: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """``cases``: dqsgd-link runs; ``others``: more hook runs (the measured link, the default dqsgd, its
    budget's config by hand) and the trainer over processes on a measured link."""
    runs = {name: link_run(rank, world, kw) for name, kw in {**cases, **(others or {})}.items()}
    if others:
        runs["measured-trainer"] = measured_trainer(rank, world)
    return {"trainer": trainer_run(rank, world), **runs}
