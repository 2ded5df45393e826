"""What one run of the engine returns, whichever transport ran it."""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, field

import torch

from dqsgd.dq.algorithms import RunConfig
from dqsgd.dq.engine import EvalRecord, Master, MsgRecord

__all__ = ["RunResult", "collect"]


@dataclass
class RunResult:
    cfg: RunConfig
    transport: str
    d: int
    n: int
    m: int                                   # master updates per epoch
    evals: list[EvalRecord]
    messages: list[MsgRecord]                # every uplink message, in the order the master handled it
    worker_sent: list[list[tuple[int, str]]]  # per worker: (seq, kind) of every message it sent
    staleness: dict[int, int]                # histogram over all arriving gradients (applied or not)
    bx: dict[int, int]                       # histogram of model-message widths (0 flag, 32 fp32)
    reached: EvalRecord | None
    diverged: bool
    updates: int
    epochs: int
    inner_up_bytes: int
    inner_down_bytes: int
    sync_bytes: int
    timers: dict[str, float]
    sim_time: float
    wall_s: float
    x_final: torch.Tensor = field(repr=False, default_factory=lambda: torch.zeros(0))

    @property
    def order(self) -> list[tuple[int, int]]:
        """(worker, seq) of the uplink messages in handling order (replayable by the torch transport)."""
        return [(r.worker, r.seq) for r in self.messages]

    @property
    def bits(self) -> int:
        return 8 * (self.inner_up_bytes + self.inner_down_bytes)

    @property
    def x_crc(self) -> int:
        return zlib.crc32(self.x_final.numpy().tobytes())

    def summary(self) -> dict:
        rej = sum(1 for r in self.messages if r.kind == "grad" and not r.applied)
        return {
            "algorithm": self.cfg.algorithm, "transport": self.transport, "d": self.d, "n": self.n, "m": self.m,
            "updates": self.updates, "epochs": self.epochs, "rejected_stale": rej, "diverged": self.diverged,
            "final_loss": self.evals[-1].loss if self.evals else None,
            "bits": self.bits, "bits_up": 8 * self.inner_up_bytes, "bits_down": 8 * self.inner_down_bytes,
            "bits_sync": 8 * self.sync_bytes,
            "reached": self.reached.to_json() if self.reached else None,
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness.items())},
            "bx_hist": {str(k): v for k, v in sorted(self.bx.items())},
            "timers": self.timers, "sim_time": self.sim_time, "wall_s": self.wall_s, "x_crc": self.x_crc,
            "config": asdict(self.cfg),
        }


def collect(master: Master, transport: str, worker_sent: list[list[tuple[int, str]]],
            worker_timers: list[dict[str, float]], sim_time: float, wall_s: float) -> RunResult:
    timers: dict[str, float] = dict(master.timers)
    for t in worker_timers:
        for k, v in t.items():
            timers[k] = timers.get(k, 0.0) + v
    return RunResult(
        master.cfg, transport, master.p.d, master.p.n, master.m, list(master.evals), list(master.messages),
        worker_sent, dict(master.staleness), dict(master.bx), master.reached, master.diverged, master.updates,
        master.epoch, master.inner.up_bytes, master.inner.down_bytes, master.sync.up_bytes + master.sync.down_bytes,
        timers, sim_time, wall_s, master.x.clone())
