"""Rank functions of the engine equivalence test: the trainer and the DDP hook on the same bucket.

Each rank runs, for every (method, topology) case, ``STEPS`` steps of the trainer over the torch
transport (what ``dqsgd train --transport torch`` runs on each rank) and ``STEPS`` steps of DDP with
the dqsgd hook on the same model, data order, seed and method; it records every uplink payload this
rank encoded (per step, per shard), the width of every step, and the final parameters.

The model is ``logreg`` (a weight and a bias: one DDP bucket). DDP runs with
``find_unused_parameters=True``, which keeps its first bucket layout (the model's parameter order,
the trainer's flat order) instead of rebuilding it in gradient-ready order after the first step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 5
METHODS = ("qsgd-4bit", "dqsgd", "signsgd", "terngrad")
TOPOLOGIES = ("sharded", "allgather")
# Sharded only: dqsgd at a budget whose pair of widths (uplink, downlink "auto") moves within STEPS at W = 2 and 4;
# dqsgd-coded, whose downlink is entropy-coded by default (its budget charged the coded bytes).
VARIANTS = {"dqsgd-t3": ("dqsgd", {"target_bits": 3.0}), "dqsgd-coded": ("dqsgd-coded", {})}
CASES = [(m, t) for m in METHODS for t in TOPOLOGIES] + [(m, "sharded") for m in VARIANTS]


def config_of(method: str) -> Any:
    """The method config of a case label (a registered name, or a :data:`VARIANTS` label)."""
    from dqsgd.method.config import method_config

    name, overrides = VARIANTS.get(method, (method, {}))
    return method_config(name, **overrides)
SEED = 7


def train_config(topology: str, workers: int, **train: Any) -> Any:
    """``train``: more TrainConfig keys (the downlink's, e.g.)."""
    from dqsgd.train.config import TrainConfig

    return TrainConfig(name="eq", dataset="synthetic", model="logreg", workers=workers, steps=STEPS, batch_size=16,
                       lr=0.05, topology=topology, eval_every=1000, coded_every=0, threads=1, **train)


class Recorder:
    """Every payload row this process encodes (through the protocol or the hook's in-place path)."""

    def __init__(self) -> None:
        from dqsgd.topology import payloads
        from dqsgd.topology.bucket import BucketProtocol

        self.rows: list[tuple[int, list[bytes]]] = []
        self.down: list[int] = []  # the downlink width of every shard this process served, in order
        self.down_payloads: list[bytes] = []  # and its downlink payload
        encode, messages, down = BucketProtocol.encode, payloads.encode_messages, BucketProtocol.encode_down_fed

        def spy_encode(proto, worker, flat, bits, *args, **kw):  # type: ignore[no-untyped-def]
            out, res = encode(proto, worker, flat, bits, *args, **kw)
            self.rows.append((bits, [bytes(p.numpy().tobytes()) for p in out]))
            return out, res

        def spy_messages(shards, bounds, flat, bits, rngs):  # type: ignore[no-untyped-def]
            got = messages(shards, bounds, flat, bits, rngs)
            if got is not None:
                send, sizes = got
                at, row = 0, []
                for n in sizes:
                    row.append(send[at : at + n].numpy().tobytes())
                    at += n + 1
                self.rows.append((bits, row))
            return got

        def spy_down(proto, shard, avg, step, residual, size=None, bad=None, dbits=None):  # type: ignore[no-untyped-def]
            self.down.append(proto.down_bits if dbits is None else dbits)
            pay, res = down(proto, shard, avg, step, residual, size, bad, dbits)
            n = len(pay) if proto.coded_down else proto.down_sizes(dbits)[shard]
            self.down_payloads.append(pay[:n].numpy().tobytes())
            return pay, res

        BucketProtocol.encode = spy_encode  # type: ignore[method-assign]
        BucketProtocol.encode_down_fed = spy_down  # type: ignore[method-assign]
        payloads.encode_messages = spy_messages  # type: ignore[assignment]

    def take(self) -> list[tuple[int, list[bytes]]]:
        rows, self.rows = self.rows, []
        return rows

    def take_down(self) -> list[int]:
        down, self.down = self.down, []
        return down

    def take_down_payloads(self) -> list[bytes]:
        down, self.down_payloads = self.down_payloads, []
        return down


def run_trainer(method: str, topology: str, transport: Any = None, workers: int = 2, **train: Any) -> tuple[Any, Any]:
    """The trainer for STEPS steps (``transport``: None = the simulation; ``train``: more TrainConfig
    keys); returns it and its ledger."""
    from dqsgd.data import load_dataset
    from dqsgd.train.config import MethodEntry
    from dqsgd.train.trainer import Trainer

    tr = Trainer(train_config(topology, workers, **train), MethodEntry(method, config_of(method)),
                 load_dataset("synthetic"), SEED, transport)
    for _ in range(STEPS):
        tr.step()
    return tr, tr.ledger


def run_ddp(rank: int, world: int, method: str, topology: str, like: Any, **hook: Any) -> torch.Tensor:
    """DDP with the dqsgd hook, the trainer ``like``'s model, data order, learning rate and seed
    (``hook``: more HookState arguments)."""
    import dqsgd.ddp
    from dqsgd.core.rng import MODEL_INIT, seed_for
    from dqsgd.models import build_model
    from dqsgd.train.sampling import WorkerBatches

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_for(SEED, MODEL_INIT))
        model = build_model("logreg", like.data)
    ddp = DDP(model, bucket_cap_mb=25, find_unused_parameters=True)
    state = dqsgd.ddp.HookState(config_of(method), None, seed=SEED, timeout=60.0, total_steps=STEPS, topology=topology, **hook)
    ddp.register_comm_hook(state, dqsgd.ddp.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=like.lr, momentum=0.0)
    batches = WorkerBatches(len(like.data.train.y), world, like.cfg.batch_size, SEED)
    for step in range(STEPS):
        idx = batches.indices(rank, step)
        opt.zero_grad()
        F.cross_entropy(ddp(like.data.train.x[idx]), like.data.train.y[idx]).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def engines(rank: int, world: int) -> dict[str, Any]:
    """Every case on this rank: the trainer's and the hook's payload rows, widths and parameters."""
    from dqsgd.transport import make_transport

    rec, out = Recorder(), {}
    for method, topology in CASES:
        tr, _ = run_trainer(method, topology, make_transport(topology, timeout=60.0), world)
        trainer_rows, trainer_down, trainer_dp = rec.take(), rec.take_down(), rec.take_down_payloads()
        params = run_ddp(rank, world, method, topology, tr)
        out[f"{method}/{topology}"] = {
            "trainer_rows": trainer_rows, "hook_rows": rec.take(),
            "trainer_down": trainer_down, "hook_down": rec.take_down(),
            "trainer_down_payloads": trainer_dp, "hook_down_payloads": rec.take_down_payloads(),
            "trainer_down_bytes": [r.down_bytes for r in tr.ledger.records],
            "trainer_params": torch.cat([p.detach().reshape(-1) for p in tr.params]), "hook_params": params,
            "trainer_bits": [r.bits for r in tr.ledger.records]}
    return out
