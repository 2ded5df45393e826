"""Streaming Local SGD in the trainer: ``train.fragments`` = F fragments on a staggered schedule, each
exchange overlapped with the next ``train.overlap_steps`` = τ inner steps (:mod:`dqsgd.train.fragments`).

Every process keeps, as in unfragmented rounds (:mod:`dqsgd.train.local`), the synchronized model θ in
the trainer's ``model`` and each local worker's own parameters and inner optimizer; θ_f changes when
fragment f's exchange completes. The ledger records each exchange at the step it completes (its width,
uplink, downlink and per-rank bytes); a step's result sums the exchanges completed at that step.

The simulated clock (:mod:`dqsgd.train.slownodes`) runs one clock per worker: each inner step adds the
worker's compute time; an exchange starts when the slowest worker has issued it and the link is free
(exchanges are served one after another), takes the link time of its busiest rank, and a worker waits
for it only when it completes, τ steps later: a link time shorter than τ steps of compute is hidden.

A checkpoint taken while an exchange is in flight waits for its result (every rank holds it; the bytes
were sent) and stores it unapplied with the workers' snapshots; the resumed run applies it at its step,
so a run resumed anywhere equals the run that was not stopped.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Callable

import torch

from dqsgd.quantizers.sparse import SPARSE_SCHEMES
from dqsgd.topology.ledger import Ledger
from dqsgd.topology.sparse import local_step_for
from dqsgd.topology.step import StepOutcome, all_finite
from dqsgd.train.fragments import Exchanger, Fragment, Pending, Streaming, build_fragments, check_streaming
from dqsgd.train.local import LocalRounds, RoundHost
from dqsgd.train.metrics import StepResult

__all__ = ["FragmentLedger", "StreamingRounds", "rounds_for"]


@dataclasses.dataclass
class FragmentLedger(Ledger):
    """The run's ledger where an exchange carries one fragment: ``coords[i]``, the coordinates of record i,
    so that the fp32 reference of an exchange (4 bytes per coordinate it carries, per worker) and the
    mean width count what each exchange carried, not the whole model every time."""

    coords: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, led: Ledger, coords: list[int]) -> FragmentLedger:
        if len(coords) != len(led.records):
            raise ValueError(f"the Local SGD state counts {len(coords)} exchanges, the ledger {len(led.records)}")
        return cls(led.numel, led.workers, led.budget_bits, list(led.records), led.topology, led.both_legs,
                   [int(c) for c in coords])

    def fp32_up_bytes(self) -> int:
        return 4 * self.workers * sum(self.coords)

    def _ratio_on_coded_steps(self, sizes: Any) -> float | None:
        recs = [(r, c) for r, c in zip(self.records, self.coords) if r.coded_up is not None]
        if not recs:
            return None
        sent = sum(sizes) + sum(r.side_bytes for r, _ in recs) * self.workers // 2
        return 4 * self.workers * sum(c for _, c in recs) / sent if sent else float("inf")

    def mean_bits(self) -> float:
        total = sum(self.coords)
        return sum(r.bits * c for r, c in zip(self.records, self.coords)) / total if total else 0.0


class StreamingRounds(LocalRounds, Streaming):
    """The trainer's step with fragments and overlap: :meth:`step` is one inner step of every local worker,
    then the exchanges issued and completed after it."""

    def __init__(self, tr: RoundHost, momentum: float, fragments: int, overlap: int):
        cfg = tr.cfg
        if cfg.local_period != "fixed":
            raise ValueError("train.fragments / train.overlap_steps need train.local_period = 'fixed'")
        if cfg.backup_workers:
            raise ValueError("train.fragments / train.overlap_steps: not with backup workers (they serve one exchange "
                             "per step by arrival)")
        if tr.entry.config.scheme == "sketch":
            raise ValueError(f"method {tr.entry.label!r}: Sketched SGD's two-round exchange does not run in fragments")
        check_streaming(fragments, overlap, cfg.local_steps, len(tr.params), "train.", "overlap_steps")
        super().__init__(tr, momentum)
        sizes = [p.numel() for p in tr.params]
        self.frags: list[Fragment] = build_fragments(tr.entry.config, sizes, fragments, cfg.local_steps, cfg.steps,
                                                     tr.topology, cfg.workers, tr.seed, tr.downlink)
        budgets = [fr.budget_bits(tr.downlink.auto) for fr in self.frags]
        tr.ledger = FragmentLedger.of(tr.ledger, [])
        tr.state = self.frags[0].state  # what a step reports (its width) until the first exchange completes
        tr.ledger.budget_bits = None if budgets[0] is None else sum(b or 0 for b in budgets)
        self.local_steps, self.overlap = cfg.local_steps, overlap
        self.exchanger = Exchanger(tr.transport, overlap)
        self.pending: list[Pending] = []
        self.serial = 0
        self.clock = [tr.timer.elapsed] * cfg.workers  # each worker's simulated time
        self.link_free = 0.0                            # when the link has served the exchanges so far

    # --- the host's workers ---------------------------------------------------------------------
    def locals_of(self, frag: Fragment) -> dict[int, torch.Tensor]:
        return {w: v[frag.a: frag.b].clone() for w, v in self.local.items()}

    def set_local(self, frag: Fragment, worker: int, value: torch.Tensor) -> None:
        self.local[worker][frag.a: frag.b] = value

    def ready_s(self) -> float:
        return max(self.clock)

    # --- a step ---------------------------------------------------------------------------------
    def step(self) -> StepResult:
        tr = self.tr
        n, lr, losses, compute_s = self.timed_inner_step()
        times = tr.timer.model.compute_times(tr.timer.seed, n, self.cfg.workers)
        self.clock = [c + float(t) for c, t in zip(self.clock, times)]
        t1 = time.perf_counter()
        done = [d for d in self.advance(n + 1, n + 1 == self.cfg.steps) if d is not None]
        if n + 1 == self.cfg.steps:
            self.exchanger.close()
        loss = tr.transport.mean_loss(losses)
        tr.timer.elapsed = max(self.clock)
        if not done:
            return StepResult(n, loss, lr, tr.state.bits, False, [], 0, 0, compute_s, 0.0, 0.0,
                              sim_time_s=tr.timer.elapsed)
        up = [sum(col) for col in zip(*(d["up"] for d in done))] if all(d["up"] for d in done) else []
        coded = [sum(col) for col in zip(*(d["coded"] for d in done))] if all(d["coded"] for d in done) else None
        encode_s = sum(d["encode_s"] for d in done)
        return StepResult(n, loss, lr, done[-1]["bits"], False, up, sum(d["down"] for d in done),
                          sum(d["side"] for d in done), compute_s, encode_s,
                          max(0.0, time.perf_counter() - t1 - encode_s), coded, sum(d["coded_s"] for d in done),
                          tr.timer.elapsed)

    def job(self, frag: Fragment, vectors: dict[int, torch.Tensor], index: int, serial: int) -> Callable[[Any], Any]:
        tr, on_nonfinite, state = self.tr, self.cfg.on_nonfinite, frag.state

        def run(t: Any) -> StepOutcome | None:
            if not all_finite(t, vectors, index, on_nonfinite):
                return None
            return frag.runner.run(t, vectors, state, index, tr.qgen, measure_coded=tr.measures_coded(serial))
        return run

    def finish(self, p: Pending, out: StepOutcome | None) -> dict[str, Any] | None:
        """Account for and apply a completed exchange (None: skipped, a worker's Δ was not finite: the
        fragment's workers restart from θ_f, as an unfragmented round does)."""
        tr, fr, n = self.tr, p.frag, self.tr.next_step
        if out is None:
            if not tr.skipped:
                warnings.warn(f"step {n}: a worker's pseudo-gradient of fragment {fr.index} is NaN or Inf: its exchange "
                              "is skipped on every rank (train.on_nonfinite = 'skip'); later skips are only counted",
                              RuntimeWarning, stacklevel=2)
            tr.skipped += 1
            for w in self.local:
                self.set_local(fr, w, self.start[fr.a: fr.b])
            return None
        coded = None if out.coded is None else tr.gather_coded(out.coded)
        up, wire = out.uplink(), out.wire() if out.up else ([], [])
        busiest = max((a + b for a, b in zip(*wire)), default=0)
        end = max(p.ready_s, self.link_free) + tr.timer.model.comm_s(busiest, tr.timer.rounds)
        self.link_free = end
        self.clock = [max(c, end) for c in self.clock]
        bits = fr.state.bits
        if up:  # the aggregating process
            tr.ledger.record(n, bits, up, sum(out.down), out.side, *wire, coded_up=coded)
            tr.ledger.coords.append(fr.b - fr.a)
        assert out.state is not None
        fr.state = tr.state = out.state  # the trainer's state: the last exchange's (its width is reported)
        self.apply(p, out.update.to(tr.device), tr.optimizer, tr.params, self.cfg.outer_lr)
        return {"up": up, "down": sum(out.down), "side": out.side, "bits": bits, "coded": coded,
                "encode_s": out.encode_s, "coded_s": out.coded_s}

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        coords = getattr(self.tr.ledger, "coords", [])
        return {**super().state_dict(), "streaming": self.streaming_state(), "clock": list(self.clock),
                "link_free": self.link_free, "coords": list(coords) if self.tr.transport.is_server else None}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        if "streaming" not in sd:
            raise ValueError("the Local SGD state has no fragments: it is of a run without train.fragments / "
                             "train.overlap_steps")
        self.load_streaming_state(sd["streaming"])
        self.clock, self.link_free = [float(c) for c in sd["clock"]], float(sd["link_free"])
        if sd["coords"] is not None:  # the trainer loaded the ledger's records (the aggregating process)
            self.tr.ledger = FragmentLedger.of(self.tr.ledger, sd["coords"])


def rounds_for(tr: RoundHost, momentum: float) -> LocalRounds:
    """The trainer's Local SGD rounds: streaming with ``train.fragments`` > 1 or ``train.overlap_steps`` > 0."""
    cfg = tr.cfg
    if tr.method.config.scheme in SPARSE_SCHEMES and not cfg.streaming:  # fragments build their own step objects
        tr.step_runner = local_step_for(tr.method, tr.topology, [tr.method.numel], cfg.workers, tr.seed, tr.downlink)
        tr.policy = tr.step_runner.policy  # the sharded exchange prices W messages per worker
        tr.state = tr.method.init_state(cfg.workers, tr.policy)
    return StreamingRounds(tr, momentum, cfg.fragments, cfg.overlap_steps) if cfg.streaming else LocalRounds(tr, momentum)
