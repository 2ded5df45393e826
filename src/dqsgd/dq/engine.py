"""The asynchronous parameter server with SVRG epochs (docs/algorithms.md §9.2, §9.4): master and workers.

Both are reactive state machines over bytes, so the event-driven simulation
(:mod:`dqsgd.dq.sim`) and the torch.distributed transport (:mod:`dqsgd.dq.dist`) run the very same
code and differ only in who delivers the bytes and when.

Epoch s (M workers, m master updates):
1. master → all: SYNC_X(x̃, fp32); each worker → master: FULLGRAD(∇f_w(x̃) over its shard, fp32);
   master forms ∇f(x̃) = Σ_w (n_w/n)∇f_w(x̃) (summed in worker order: order-independent) and sends
   SYNC_G(∇f(x̃), fp32) to all. These are the *epoch-sync* bits, kept in their own ledger [OC §9.2].
2. master → each worker: MODEL(query point y_0) — x_0 = x̃ for the plain methods, so that is the
   1-byte "use snapshot" flag; Acc-* sends Q(θx_0 + (1−θ)x̃).
3. Inner loop. Every GRAD that arrives is one event: staleness = t − D(t) (t: updates applied in
   this epoch; D(t): the version the worker computed at). If staleness > τ the gradient is not
   applied and the worker gets the fresh model to recompute (its bits still count). Otherwise
   x ← prox_{ηh}(x − η·Q(α)) (Acc: prox_{(η/θ)h}(x − (η/θ)Q(α))) and t ← t + 1. The reply goes to
   that worker only: a MODEL with the quantized query point, or HOLD once t + (in flight) reaches
   the epoch's budget m (so exactly m gradients are applied per epoch and no work is wasted).
4. When t = m and nothing is in flight: x̃ ← x_m (Acc: x̃ ← θ·mean(x_1..x_m) + (1−θ)x̃, and
   x_0^(s+1) = x_m^s), then the next epoch or STOP. Reaching the loss target lowers the budget to
   what is already in flight (those gradients are still applied), then stops.

Invariants (tested): every uplink message (worker, seq) is handled exactly once; t + in-flight ≤
budget; no applied gradient has staleness > τ.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from dqsgd.core.rng import DQ_MASTER, DQ_QUANT, DQ_SAMPLE, generator
from dqsgd.dq.algorithms import RunConfig, make_codecs
from dqsgd.dq.gradq import Fp32Grad
from dqsgd.dq.messages import Down, DownKind, Up, UpKind, pack_down, pack_up, unpack_down, unpack_up
from dqsgd.dq.modelq import ModelKind, decode_model, encode_model
from dqsgd.dq.problem import Problem
from dqsgd.topology.ledger import Ledger
from dqsgd.method.pipeline import ProtocolError

__all__ = ["Master", "Worker", "MsgRecord", "EvalRecord", "shard_sizes"]

_FP32 = Fp32Grad()


def shard_sizes(n: int, workers: int) -> list[int]:
    return [len(s) for s in torch.tensor_split(torch.arange(n), workers)]


@dataclass(frozen=True)
class MsgRecord:
    """One uplink message as the master handled it."""

    worker: int
    seq: int
    kind: str            # "grad" | "fullgrad"
    epoch: int
    version: int
    staleness: int       # t − D(t) (0 for fullgrad)
    applied: bool        # False: rejected as too stale (grad only)
    up_bytes: int
    down_bytes: int      # the direct reply (0 for fullgrad)
    down_bits_x: int     # b_x of the reply model (0 snapshot flag / HOLD, 32 fp32)


@dataclass(frozen=True)
class EvalRecord:
    updates: int
    epoch: int
    loss: float
    up_bits: int         # inner-loop uplink, measured
    down_bits: int       # inner-loop downlink, measured
    sync_bits: int       # epoch-sync traffic, both directions, measured
    sim_time: float      # the transport's clock (sim: simulated seconds; torch: wall seconds)
    wall_time: float     # wall seconds since the master started

    @property
    def bits(self) -> int:
        return self.up_bits + self.down_bits

    def to_json(self) -> dict:
        return {**asdict(self), "bits": self.bits, "bits_with_sync": self.bits + self.sync_bits}


@dataclass
class _EpochState:
    t: int = 0                     # updates applied in this epoch
    in_flight: int = 0
    budget: int = 0
    busy: set[int] = field(default_factory=set)
    fullgrads: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    sync_down: int = 0             # bytes of SYNC_X + SYNC_G per worker
    collecting: bool = False       # between SYNC_X and the last FULLGRAD of the epoch
    x_sum: torch.Tensor | None = None


class Master:
    """Rank 0: owns x, x̃, ∇f(x̃), the ledgers and the logs. ``handle`` is the whole protocol."""

    def __init__(self, problem: Problem, cfg: RunConfig, clock=None) -> None:
        self.p, self.cfg = problem, cfg
        self.algo, self.grad_codec, self.policy = make_codecs(cfg)
        self.M = cfg.workers
        self.m = cfg.inner or max(cfg.workers, problem.n // cfg.batch)
        self.tau = cfg.staleness_bound
        self.gen = generator(cfg.seed, DQ_MASTER)
        self.x = problem.x0.clone()
        self.x_tilde = self.x.clone()
        self.full = torch.zeros(problem.d)
        self.epoch, self.updates = 0, 0
        self.ep = _EpochState()
        self.stopping = self.done = self.diverged = False
        self.n_w = shard_sizes(problem.n, self.M)
        self.inner = Ledger(problem.d, 1)          # one record per master event (one worker each)
        self.sync = Ledger(problem.d, self.M)      # one record per epoch sync (broadcast + M uploads)
        self.messages: list[MsgRecord] = []
        self.evals: list[EvalRecord] = []
        self.reached: EvalRecord | None = None
        self.staleness: Counter[int] = Counter()
        self.bx: Counter[int] = Counter()
        self.seen: set[tuple[int, int]] = set()
        self.timers: Counter[str] = Counter()
        self.clock = clock or (lambda: 0.0)
        self._t0 = time.perf_counter()

    # --- points ---------------------------------------------------------------------------------
    @property
    def theta(self) -> float:
        return self.cfg.theta_at(self.epoch) if self.algo.accelerated else 1.0

    def query(self) -> torch.Tensor:
        """y_t = θx_t + (1−θ)x̃ (Acc), else x_t: what workers compute at and what is evaluated [OC]."""
        if not self.algo.accelerated:
            return self.x
        return self.x * self.theta + self.x_tilde * (1.0 - self.theta)

    # --- protocol -------------------------------------------------------------------------------
    def start(self) -> list[tuple[int, bytes]]:
        self._evaluate()
        return self._begin_epoch()

    def handle(self, worker: int, data: bytes) -> list[tuple[int, bytes]]:
        """Process one uplink message from ``worker``; return the messages to send, in order."""
        m = unpack_up(data)
        if m.worker != worker or not 0 <= worker < self.M:
            raise ProtocolError(f"message claims worker {m.worker}, arrived from worker {worker}")
        if (worker, m.seq) in self.seen:
            raise ProtocolError(f"duplicate message (worker {worker}, seq {m.seq})")
        if m.epoch != self.epoch or self.done:
            raise ProtocolError(f"worker {worker}: message of epoch {m.epoch}, master is in epoch {self.epoch}")
        self.seen.add((worker, m.seq))
        if m.kind == UpKind.FULLGRAD:
            return self._on_fullgrad(worker, m, len(data))
        return self._on_grad(worker, m, len(data))

    def _begin_epoch(self) -> list[tuple[int, bytes]]:
        self.ep = _EpochState(collecting=True)
        msg = pack_down(Down(DownKind.SYNC_X, self.epoch, 0, _FP32.encode(self.x_tilde, None)))
        self.ep.sync_down = len(msg)
        return [(w, msg) for w in range(self.M)]

    def _on_fullgrad(self, w: int, m: Up, nbytes: int) -> list[tuple[int, bytes]]:
        if w in self.ep.fullgrads or not self.ep.collecting:
            raise ProtocolError(f"worker {w}: unexpected full gradient in epoch {self.epoch} (seq {m.seq})")
        self.ep.fullgrads[w] = (_FP32.decode(m.payload, self.p.d), nbytes)
        self.messages.append(MsgRecord(w, m.seq, "fullgrad", m.epoch, m.version, 0, True, nbytes, 0, 0))
        if len(self.ep.fullgrads) < self.M:
            return []
        full = torch.zeros(self.p.d)
        for v in range(self.M):  # worker order: the sum does not depend on arrival order
            full.add_(self.ep.fullgrads[v][0], alpha=self.n_w[v] / self.p.n)
        self.full = full
        msg = pack_down(Down(DownKind.SYNC_G, self.epoch, 0, _FP32.encode(full, None)))
        self.ep.sync_down += len(msg)
        self.sync.record(self.epoch, 32, [self.ep.fullgrads[v][1] for v in range(self.M)], self.ep.sync_down)
        self.ep.fullgrads, self.ep.collecting = {}, False
        self.ep.x_sum = torch.zeros(self.p.d) if self.algo.accelerated else None
        left = self.cfg.max_updates - self.updates if self.cfg.max_updates else self.m
        self.ep.budget = 0 if self.stopping else min(self.m, left)
        out = [(w2, msg) for w2 in range(self.M)]
        for w2 in range(self.M):
            reply, _ = self._reply(w2)
            self.inner.record(self.updates, self.grad_codec.nominal_bits, [0], len(reply))
            out.append((w2, reply))
        if self.ep.in_flight == 0:  # nothing to do this epoch (stopped, or the update cap is reached)
            out += self._end_epoch()
        return out

    def _reply(self, w: int) -> tuple[bytes, int]:
        """MODEL if there is budget left for one more gradient, else HOLD; returns (bytes, b_x)."""
        ep = self.ep
        if ep.t + ep.in_flight >= ep.budget:
            return pack_down(Down(DownKind.HOLD, self.epoch, ep.t)), 0
        t0 = time.perf_counter()
        payload, choice = encode_model(self.query(), self.x_tilde, self.policy, self.gen)
        self.timers["master_encode_s"] += time.perf_counter() - t0
        bx = {ModelKind.SNAPSHOT: 0, ModelKind.FP32: 32}.get(choice.kind, choice.bits)
        self.bx[bx] += 1
        ep.in_flight += 1
        ep.busy.add(w)
        return pack_down(Down(DownKind.MODEL, self.epoch, ep.t, payload)), bx

    def _on_grad(self, w: int, m: Up, nbytes: int) -> list[tuple[int, bytes]]:
        ep = self.ep
        if w not in ep.busy:
            raise ProtocolError(f"worker {w} sent a gradient it was not asked for (seq {m.seq})")
        if m.version > ep.t:
            raise ProtocolError(f"worker {w}: version {m.version} is ahead of the master's {ep.t}")
        ep.busy.discard(w)
        ep.in_flight -= 1
        stale = ep.t - m.version
        self.staleness[stale] += 1
        applied = stale <= self.tau
        if applied:
            t0 = time.perf_counter()
            self._apply(self.grad_codec.decode(m.payload, self.p.d))
            self.timers["master_apply_s"] += time.perf_counter() - t0
            if self.updates % self.cfg.eval_every == 0:
                self._evaluate()
        reply, bx = self._reply(w)
        self.inner.record(self.updates, self.grad_codec.nominal_bits, [nbytes], len(reply))
        self.messages.append(MsgRecord(w, m.seq, "grad", m.epoch, m.version, stale, applied, nbytes, len(reply), bx))
        out = [(w, reply)]
        if ep.in_flight == 0 and ep.t >= ep.budget:
            out += self._end_epoch()
        return out

    def _apply(self, alpha: torch.Tensor) -> None:
        step = self.cfg.lr / self.theta
        self.x = self.p.prox(self.x.add_(alpha, alpha=-step), step)
        if self.ep.x_sum is not None:
            self.ep.x_sum.add_(self.x)
        self.ep.t += 1
        self.updates += 1
        if not self.diverged and not bool(torch.isfinite(self.x).all()):
            self.diverged = True  # no model can be sent any more: drain what is in flight and stop
            self._stop()

    def _end_epoch(self) -> list[tuple[int, bytes]]:
        ep = self.ep
        if self.algo.accelerated:
            if ep.t and ep.x_sum is not None:
                th = self.theta
                self.x_tilde = (ep.x_sum / ep.t) * th + self.x_tilde * (1.0 - th)
        else:
            self.x_tilde = self.x.clone()
        self.epoch += 1
        capped = bool(self.cfg.max_updates) and self.updates >= self.cfg.max_updates
        if self.stopping or capped or self.epoch >= self.cfg.epochs:
            return self._finish()
        return self._begin_epoch()

    def _finish(self) -> list[tuple[int, bytes]]:
        if not self.evals or self.evals[-1].updates != self.updates or self.algo.accelerated:
            self._evaluate()
        self.done = True
        msg = pack_down(Down(DownKind.STOP, self.epoch, 0))
        for _ in range(self.M):
            self.inner.record(self.updates, self.grad_codec.nominal_bits, [0], len(msg))
        return [(w, msg) for w in range(self.M)]

    # --- evaluation -----------------------------------------------------------------------------
    def _evaluate(self) -> None:
        t0 = time.perf_counter()
        loss = self.p.loss(self.query())
        self.timers["eval_s"] += time.perf_counter() - t0
        sync = 8 * (self.sync.up_bytes + self.sync.down_bytes)
        rec = EvalRecord(self.updates, self.epoch, loss, 8 * self.inner.up_bytes, 8 * self.inner.down_bytes,
                         sync, float(self.clock()), time.perf_counter() - self._t0)
        self.evals.append(rec)
        if not loss == loss or loss > 1e6:  # NaN or blown up: stop issuing work
            self.diverged = True
            self._stop()
        elif not self.diverged and self.cfg.target > 0 and loss < self.cfg.target and self.reached is None:
            self.reached = rec
            if self.cfg.stop_at_target:
                self._stop()

    def _stop(self) -> None:
        self.stopping = True
        self.ep.budget = min(self.ep.budget, self.ep.t + self.ep.in_flight)


class Worker:
    """One worker: holds x̃, ∇f(x̃), its last model x̂ and its data shard; answers the master."""

    def __init__(self, wid: int, problem: Problem, cfg: RunConfig, shard: torch.Tensor) -> None:
        self.wid, self.p, self.cfg, self.shard = wid, problem, cfg, shard
        self.algo, self.grad_codec, self.policy = make_codecs(cfg)
        self.g_sample = generator(cfg.seed, DQ_SAMPLE, wid)
        self.g_quant = generator(cfg.seed, DQ_QUANT, wid)
        self.x_tilde = problem.x0.clone()
        self.full = torch.zeros(problem.d)
        self.seq = 0
        self.sent: list[tuple[int, str]] = []    # (seq, kind) of every message sent
        self.done = False
        self.timers: Counter[str] = Counter()

    def handle(self, data: bytes) -> bytes | None:
        m = unpack_down(data)
        if m.kind == DownKind.SYNC_X:
            self.x_tilde = _FP32.decode(m.payload, self.p.d)
            t0 = time.perf_counter()
            g = self.p.full_grad(self.x_tilde, self.shard)
            self.timers["fullgrad_s"] += time.perf_counter() - t0
            return self._send(UpKind.FULLGRAD, m, _FP32.encode(g, None))
        if m.kind == DownKind.SYNC_G:
            self.full = _FP32.decode(m.payload, self.p.d)
            return None
        if m.kind == DownKind.MODEL:
            x_hat = decode_model(m.payload, self.x_tilde, self.policy)
            t0 = time.perf_counter()
            idx = self.shard[torch.randint(len(self.shard), (self.cfg.batch,), generator=self.g_sample)]
            alpha = self.p.grad(x_hat, idx).sub_(self.p.grad(self.x_tilde, idx)).add_(self.full)
            t1 = time.perf_counter()
            payload = self.grad_codec.encode(alpha, self.g_quant)
            self.timers["compute_s"] += t1 - t0
            self.timers["encode_s"] += time.perf_counter() - t1
            return self._send(UpKind.GRAD, m, payload)
        if m.kind == DownKind.STOP:
            self.done = True
        return None  # HOLD / STOP: nothing to send

    def _send(self, kind: UpKind, m: Down, payload: bytes) -> bytes:
        data = pack_up(Up(kind, self.wid, self.seq, m.epoch, m.version, payload))
        self.sent.append((self.seq, kind.name.lower()))
        self.seq += 1
        return data
