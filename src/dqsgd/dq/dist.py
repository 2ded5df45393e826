"""``torch`` transport: the same master and workers over torch.distributed (gloo, CPU, loopback).

Rank 0 is the master, ranks 1..M are workers 0..M−1, one process each, spawned with
torch.multiprocessing on 127.0.0.1 and a free port. Messages are variable-length byte strings:
the size goes first (one int64, tag SIZE) and then the bytes (uint8, tag DATA), with separate tags
per direction so a size can never be matched with data.

* The master posts ``irecv(size, src=None)`` — any source — and waits for whichever worker's
  message comes first, so it never blocks on the slowest worker; it then reads that worker's
  bytes, runs :meth:`Master.handle`, and replies to that worker only (epoch syncs go to all).
* A worker waits for its next downlink message, answers it (:meth:`Worker.handle`), sends.
* Every wait has ``timeout_s``; a timeout or a dead peer raises :class:`TransportError` naming the
  rank and the operation (the process group is also created with that timeout).

Test mode ``order``: a list of (worker, seq) — e.g. a simulation's :attr:`RunResult.order`. The
master then receives from exactly that worker at each step (the others' messages wait in gloo),
and checks the seq. As master and workers are deterministic given the arrival order (seeded
per-role generators, one intra-op thread, order-independent full-gradient sum), the real run then
reproduces the simulation message for message: same bytes, same bits, same final model.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dqsgd.core.rng import DQ_SHARD, generator
from dqsgd.dq.algorithms import RunConfig
from dqsgd.dq.engine import Master, Worker
from dqsgd.dq.messages import unpack_up
from dqsgd.dq.problem import Problem, ProblemSpec
from dqsgd.dq.result import RunResult, collect
from dqsgd.method.pipeline import ProtocolError
from dqsgd.topology.payloads import bytes_tensor, tensor_bytes
from dqsgd.transport.torch_dist import TransportError

__all__ = ["run_dist", "run_dist_jobs", "free_port"]

UP_SIZE, UP_DATA, DOWN_SIZE, DOWN_DATA = 11, 12, 13, 14
_CPU = torch.device("cpu")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class _Link:
    rank: int
    timeout: datetime.timedelta

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except (RuntimeError, dist.DistError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise TransportError(f"rank {self.rank}: {what} failed or timed out after "
                                 f"{self.timeout.total_seconds():.0f}s [{first}]") from e

    def send(self, data: bytes, dst: int, size_tag: int, data_tag: int) -> None:
        size = torch.tensor([len(data)], dtype=torch.int64)
        body = bytes_tensor(data, _CPU, len(data))
        works = [dist.isend(size, dst, tag=size_tag), dist.isend(body, dst, tag=data_tag)]
        for w in works:
            self._wait(w, f"send of {len(data)} bytes to rank {dst}")

    def recv(self, src: int | None, size_tag: int, data_tag: int) -> tuple[int, bytes]:
        size = torch.zeros(1, dtype=torch.int64)
        work = dist.irecv(size, src=src, tag=size_tag)
        self._wait(work, f"receive from {'any rank' if src is None else f'rank {src}'}")
        if src is None:
            src = int(work._source_rank())
        n = int(size.item())
        if not 0 < n < 1 << 31:
            raise ProtocolError(f"rank {self.rank}: rank {src} announced a message of {n} bytes")
        body = torch.empty(n, dtype=torch.uint8)
        self._wait(dist.irecv(body, src=src, tag=data_tag), f"receive of {n} bytes from rank {src}")
        return src, tensor_bytes(body, n)


def _master(problem: Problem, cfg: RunConfig, link: _Link, order: Sequence[tuple[int, int]] | None) -> RunResult:
    t0 = time.perf_counter()
    master = Master(problem, cfg, clock=lambda: time.perf_counter() - t0)
    for w, data in master.start():
        link.send(data, w + 1, DOWN_SIZE, DOWN_DATA)
    step = 0
    while not master.done:
        want = None
        if order is not None:
            if step >= len(order):
                raise ProtocolError(f"master: the prescribed order ends after {step} messages but the run goes on")
            want = order[step][0] + 1
        src, data = link.recv(want, UP_SIZE, UP_DATA)
        if order is not None and unpack_up(data).seq != order[step][1]:
            raise ProtocolError(f"master: step {step}: worker {src - 1} sent seq {unpack_up(data).seq}, "
                                f"the prescribed order says {order[step][1]}")
        for w, reply in master.handle(src - 1, data):
            link.send(reply, w + 1, DOWN_SIZE, DOWN_DATA)
        step += 1
    wall = time.perf_counter() - t0
    return collect(master, "torch", [], [], wall, wall)


def _worker(problem: Problem, cfg: RunConfig, wid: int, link: _Link) -> tuple[list[tuple[int, str]], dict[str, float]]:
    shards = problem.shards(cfg.workers, generator(cfg.seed, DQ_SHARD))
    worker = Worker(wid, problem, cfg, shards[wid])
    while not worker.done:
        _, data = link.recv(0, DOWN_SIZE, DOWN_DATA)
        up = worker.handle(data)
        if up is not None:
            link.send(up, 0, UP_SIZE, UP_DATA)
    return worker.sent, dict(worker.timers)


Job = tuple[RunConfig, "Sequence[tuple[int, int]] | None"]


def _rank_main(rank: int, world: int, port: int, spec: ProblemSpec, jobs: Sequence[Job], queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # torch's variable: keep gloo on loopback
    timeout = datetime.timedelta(seconds=max(cfg.timeout_s for cfg, _ in jobs))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timeout)
        problem = Problem(spec)
        for j, (cfg, order) in enumerate(jobs):  # one job after the other on the same process group
            link = _Link(rank, datetime.timedelta(seconds=cfg.timeout_s))
            if rank == 0:
                queue.put(("master", j, 0, _master(problem, cfg, link, order)))
            else:
                queue.put(("worker", j, rank - 1, _worker(problem, cfg, rank - 1, link)))
    except BaseException as e:  # report, then let the process die: the others time out and report too
        queue.put(("error", -1, rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_dist(spec: ProblemSpec, cfg: RunConfig, order: Sequence[tuple[int, int]] | None = None) -> RunResult:
    """Spawn 1 master + ``cfg.workers`` worker processes, run, and return the master's result with
    every worker's sent log attached (``worker_sent``) for the exactly-once checks."""
    return run_dist_jobs(spec, [(cfg, order)])[0]


def run_dist_jobs(spec: ProblemSpec, jobs: Sequence[Job]) -> list[RunResult]:
    """Several runs, one after the other, in one set of processes (spawning costs seconds).
    All jobs need the same number of workers."""
    if not jobs or len({cfg.workers for cfg, _ in jobs}) != 1:
        raise ValueError("run_dist_jobs: need at least one job, all with the same number of workers")
    workers = jobs[0][0].workers
    world = workers + 1
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.start_processes(_rank_main, args=(world, free_port(), spec, list(jobs), queue), nprocs=world,
                               join=False, start_method="spawn")
    results: dict[tuple[str, int, int], Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + sum(cfg.timeout_s for cfg, _ in jobs) * 2 + 120
    while len(results) < world * len(jobs) and not errors and time.monotonic() < deadline:
        try:
            kind, job, rank, payload = queue.get(timeout=1.0)
        except Exception:
            if not any(p.is_alive() for p in procs.processes) and queue.empty():
                break
            continue
        if kind == "error":
            errors.append(f"rank {rank}: {payload}")
        else:
            results[(kind, job, rank)] = payload
    for p in procs.processes:  # only the processes spawned here, by handle
        p.join(timeout=5 if not errors else 2 * max(cfg.timeout_s for cfg, _ in jobs))
        if p.is_alive():
            p.kill()
    if errors or len(results) != world * len(jobs):
        raise TransportError("torch transport failed:\n" + "\n".join(errors or [f"only {sorted(results)} answered"]))
    out = []
    for j in range(len(jobs)):
        res: RunResult = results[("master", j, 0)]
        res.worker_sent = [results[("worker", j, w)][0] for w in range(workers)]
        for w in range(workers):
            for k, v in results[("worker", j, w)][1].items():
                res.timers[k] = res.timers.get(k, 0.0) + v
        out.append(res)
    return out
