"""Rank functions for the backup-worker tests (spawned by ``dqsgd.cli.launch.spawn_local``)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from dqsgd.data import load_dataset
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.trainer import Trainer
from dqsgd.transport.backup import BackupPSTransport


def train_backup(rank: int, world: int, cfg: TrainConfig, entry: MethodEntry, faults: dict[int, str], at_step: int,
                 stall_s: float = 0.0) -> dict[str, Any]:
    """A run with backup workers in which each rank of ``faults`` sleeps ``stall_s`` (``"stall"``) or is
    SIGKILLed (``"kill"``) before its step ``at_step``. Returns the bytes this rank sent per exchange, and on
    the server the ledger's per-exchange uplink bytes and dropped workers; the final parameters everywhere."""
    t = BackupPSTransport(cfg.backup_workers, timeout=30)
    sent: list[int] = []
    gather = t.gather_messages

    def counted(msg, cap):  # type: ignore[no-untyped-def]
        sent.append(msg.numel() - 1)  # the payload: the message less its flag byte (the ledger's bytes)
        return gather(msg, cap)

    t.gather_messages = counted  # type: ignore[method-assign]
    with t.guard():
        tr = Trainer(cfg, entry, load_dataset("synthetic"), 0, t)
        metrics = []
        while tr.next_step < cfg.steps:
            if rank in faults and tr.next_step == at_step:
                if faults[rank] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(stall_s)
            metrics.append(tr.step().dropped)
    recs = tr.ledger.records
    return {"sent": sent, "params": tr.flat_params(), "metrics_dropped": metrics,
            "up": [list(r.up_bytes) for r in recs], "dropped": [list(r.dropped) for r in recs],
            "wasted": tr.ledger.wasted_up_bytes, "total_up": tr.ledger.up_bytes}

