"""``sim`` transport: a deterministic, seeded, event-driven simulation of M asynchronous workers.

Time model [OC, docs/algorithms.md §9.2]: each worker has its own full-duplex link of ``bandwidth_bps``
(a message of L bytes takes 8L/bandwidth seconds; messages on one link go one after another);
a gradient takes a compute time drawn i.i.d. from Exp(mean ``compute_s``) or a log-normal with
that mean and σ = ``delay_sigma`` (one generator for the whole simulation, seeded), or read from
an explicit per-worker schedule (cycled). A worker's shard full gradient takes
(n_w/batch)·compute_s/2 (one gradient per sample instead of two). The master's own processing
time is not modelled. Arrivals are handled in time order (ties by send order), so the natural
staleness is about M − 1; the histogram is in the result.

A worker computes its gradient when its model arrives (the result is the same as computing it
later: its inputs are fixed), so the message size is known when its arrival is scheduled.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from dqsgd.core.rng import DQ_DELAY, DQ_SHARD, generator
from dqsgd.dq.algorithms import RunConfig
from dqsgd.dq.engine import Master, Worker
from dqsgd.dq.messages import DownKind
from dqsgd.dq.problem import Problem
from dqsgd.dq.result import RunResult, collect

__all__ = ["DelayModel", "run_sim"]


@dataclass(frozen=True)
class DelayModel:
    """Compute times: ``kind`` "exp" | "lognormal" (mean ``mean``, σ ``sigma``) or an explicit
    ``schedule`` (per worker, its successive gradient compute times, cycled)."""

    kind: str = "exp"
    mean: float = 0.005
    sigma: float = 0.5
    schedule: tuple[tuple[float, ...], ...] | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig, schedule: Sequence[Sequence[float]] | None = None) -> "DelayModel":
        sched = None if schedule is None else tuple(tuple(float(v) for v in s) for s in schedule)
        if sched is not None and (len(sched) != cfg.workers or any(not s or min(s) < 0 for s in sched)):
            raise ValueError(f"delay schedule: need {cfg.workers} non-empty lists of times >= 0")
        return cls(cfg.delay, cfg.compute_s, cfg.delay_sigma, sched)

    def draw(self, worker: int, job: int, gen: torch.Generator) -> float:
        if self.schedule is not None:
            s = self.schedule[worker]
            return s[job % len(s)]
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if self.kind == "exp":
            return -self.mean * math.log1p(-u)
        z = float(torch.randn((), generator=gen, dtype=torch.float64))
        return math.exp(math.log(self.mean) - self.sigma ** 2 / 2 + self.sigma * z)


def run_sim(problem: Problem, cfg: RunConfig, schedule: Sequence[Sequence[float]] | None = None) -> RunResult:
    """Run ``cfg`` on ``problem`` in one process; ``schedule`` overrides the random compute times."""
    delays = DelayModel.from_config(cfg, schedule)
    gen = generator(cfg.seed, DQ_DELAY)
    now = [0.0]
    master = Master(problem, cfg, clock=lambda: now[0])
    shards = problem.shards(cfg.workers, generator(cfg.seed, DQ_SHARD))
    workers = [Worker(w, problem, cfg, shards[w]) for w in range(cfg.workers)]
    bw = cfg.bandwidth_bps
    tx = (lambda nbytes: 8.0 * nbytes / bw) if bw > 0 else (lambda nbytes: 0.0)
    heap: list[tuple[float, int, str, int, bytes]] = []
    tie = itertools.count()
    down_free, up_free, jobs = [0.0] * cfg.workers, [0.0] * cfg.workers, [0] * cfg.workers

    def send_down(t: float, w: int, data: bytes) -> None:
        down_free[w] = max(t, down_free[w]) + tx(len(data))
        heapq.heappush(heap, (down_free[w], next(tie), "down", w, data))

    def send_up(t: float, w: int, data: bytes) -> None:
        up_free[w] = max(t, up_free[w]) + tx(len(data))
        heapq.heappush(heap, (up_free[w], next(tie), "up", w, data))

    wall0 = time.perf_counter()
    for w, data in master.start():
        send_down(0.0, w, data)
    while heap:
        t, _, kind, w, data = heapq.heappop(heap)
        now[0] = t
        if kind == "up":
            for w2, d2 in master.handle(w, data):
                send_down(t, w2, d2)
            continue
        up = workers[w].handle(data)
        if up is None:
            continue
        if data[0] == DownKind.SYNC_X:
            busy = len(workers[w].shard) / cfg.batch * cfg.compute_s / 2
        else:
            busy = delays.draw(w, jobs[w], gen)
            jobs[w] += 1
        send_up(t + busy, w, up)
    if not master.done:
        raise RuntimeError("simulation ended with the master not done (protocol bug)")
    return collect(master, "sim", [wk.sent for wk in workers], [dict(wk.timers) for wk in workers],
                   now[0], time.perf_counter() - wall0)
