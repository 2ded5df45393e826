"""Functions that run inside the processes started by ``dqsgd.cli.launch.spawn_local``.

They live in an importable module (not in the test files) so that spawned processes can unpickle them.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from dqsgd.data import load_dataset
from dqsgd.method.pipeline import Method
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.trainer import Trainer
from dqsgd.transport.torch_dist import RankDisagreement, make_transport


def train(cfg: TrainConfig, entry: MethodEntry, seed: int, transport: Any) -> dict[str, Any]:
    """Every step of a run on ``transport``: chosen widths, uplink bytes (server), final parameters."""
    tr = Trainer(cfg, entry, load_dataset("synthetic"), seed, transport)
    bits, up, down, loss = [], [], [], []
    while tr.next_step < cfg.steps:
        r = tr.step()
        bits.append(r.bits)
        up.append(list(r.up_bytes))
        down.append(r.down_bytes)
        loss.append(r.loss)
    wire = [(rec.rank_up, rec.rank_down) for rec in tr.ledger.records]
    coded = [(rec.step, rec.coded_up) for rec in tr.ledger.records if rec.coded_up is not None]
    return {"bits": bits, "up": up, "down": down, "wire": wire, "coded": coded, "loss": loss,
            "params": tr.flat_params(), "next_bits": tr.state.bits}


def train_cases(rank: int, world: int, cases: list[tuple[str, TrainConfig, MethodEntry, int]]) -> dict[str, Any]:
    """Several (topology, config, method, seed) runs in one process group (start-up is the slow part),
    then one all-gather step in which rank 1 claims another B_{n+1}: every rank must notice."""
    out: dict[str, Any] = {}
    for topology, cfg, entry, seed in cases:
        t = make_transport(topology)
        with t.guard():
            out[f"{topology}/{entry.label}"] = train(cfg, entry, seed, t)
    t = make_transport("allgather")
    tr = Trainer(dataclasses.replace(cases[0][1], topology="allgather"), cases[0][2], load_dataset("synthetic"), 0, t)
    honest = t.agree
    t.agree = lambda payload, ints: honest(payload, [ints[0] + int(rank == 1)])  # type: ignore[method-assign]
    try:
        tr.step()
    except RankDisagreement as e:
        out["disagreement"] = str(e)
    return out


def train_with_fault(rank: int, world: int, topology: str, cfg: TrainConfig, entry: MethodEntry,
                     fault: str, bad_rank: int, at_step: int, stamp: str = "") -> dict[str, Any]:
    """A run in which rank ``bad_rank`` is SIGKILLed (``kill``) or sends zero bytes (``garbage``) at ``at_step``.

    ``stamp``: a file where the dying rank writes the time of its death.
    """
    if rank == bad_rank and fault == "kill":
        step = Trainer.step

        def dying_step(self: Trainer):
            if self.next_step == at_step:
                if stamp:
                    Path(stamp).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return step(self)

        Trainer.step = dying_step  # type: ignore[method-assign]
    if rank == bad_rank and fault == "garbage":
        from dqsgd.topology import payloads

        encode = payloads.encode_shard  # every payload of the bucket protocol, one per shard

        def garbage_encode(*args: Any, **kw: Any):
            msg, res = encode(*args, **kw)
            return (torch.zeros_like(msg) if garbage_encode.calls >= at_step else msg), res

        def counted(*args: Any, **kw: Any):
            out = garbage_encode(*args, **kw)
            garbage_encode.calls += 1
            return out

        garbage_encode.calls = 0
        payloads.encode_shard = counted  # type: ignore[assignment]
        batched = payloads.encode_batched  # the bucket's shards in one call: the same count, payload by payload

        def garbage_batched(*args: Any, **kw: Any):
            got = batched(*args, **kw)
            if got is not None:
                buf, at, sizes = got
                for a, n in zip(at, sizes):
                    if garbage_encode.calls >= at_step:
                        buf[a : a + n] = 0
                    garbage_encode.calls += 1
            return got

        payloads.encode_batched = garbage_batched  # type: ignore[assignment]
    t = make_transport(topology)
    with t.guard():
        return train(cfg, entry, 0, t)


class _Announced(bytes):
    """A payload that announces ``size`` bytes: what a forged or broken peer would put in the size exchange."""

    size = 0

    def __len__(self) -> int:
        return self.size


def oversized_payload(rank: int, world: int, topology: str) -> dict[str, Any]:
    """Rank 1 announces a 400 MB uplink payload; every rank must refuse it before allocating.

    Returns the error text and how much this process's peak memory grew (KiB, ru_maxrss).
    """
    import resource

    from dqsgd.codecs import PayloadError
    from dqsgd.method.config import method_config
    from dqsgd.topology.exchange import size_table
    from dqsgd.topology.refusal import check_table

    method = Method(method_config("qsgd-4bit"), 5000, 10)
    cap = method.max_payload_bytes(4)
    honest = bytes(100)
    payload: bytes = honest
    if rank == 1:
        payload = _Announced(honest)
        payload.size = 400_000_000  # type: ignore[attr-defined]
    t = make_transport(topology, timeout=20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        if topology == "sharded":
            t.exchange([[payload if j == 0 else honest for j in range(world)]], [cap] * world)
        else:  # the exchange's size table (ps, allgather), checked by every rank before the payloads move
            g = t.exchange_groups()[rank]
            check_table(g.wait(size_table(g, [len(payload)], False, torch.device("cpu"))), [cap], f"rank {rank}: ")
        error = None
    except PayloadError as e:
        error = str(e)
    return {"error": error, "grew_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, "cap": cap}
