"""Streaming Local SGD (as Streaming DiLoCo): the parameters in F fragments on a staggered schedule, each
exchange overlapped with the next τ inner steps. What the trainer's rounds (:mod:`dqsgd.train.streaming`)
and :class:`~dqsgd.train.local_sgd.LocalSGDOptimizer` share.

Fragments. The parameter tensors, in the model's order, cut into F contiguous groups of nearly equal
element counts (:func:`split`); a fragment is never cut inside a tensor, so F is at most the number of
tensors. Fragment f has its own step object and method state (quantization width, error feedback, a
budget of its share of the coordinates), and the outer optimizer steps its parameters alone (momentum
is per parameter, so the outer optimizer is per fragment).

Schedule. With period H, fragment f has the offset o_f = ⌊f·H/F⌋ (F ≤ H: all distinct, spread evenly
over H); its exchange is issued after the c-th inner step (c = 1, 2, ...) when c ≡ o_f (mod H): once
every H steps. At the run's end (c = steps) every exchange in flight completes, and every fragment that
progressed since its last snapshot is exchanged once more (blocking), so the final model holds every
step. F = 1, τ = 0 is the unfragmented rounds: one exchange every H steps and one at the end.

Overlap and the merge. The exchange of fragment f issued after step c carries Δ_{w,f} = θ_f − θ_{w,f}(c)
(θ_f: the synchronized fragment; θ_{w,f}(c): worker w's at the snapshot). It runs while the workers take
steps c+1 … c+τ, and after step c+τ its result is applied: the outer optimizer turns the decoded average
Δ̂_f into θ_f', and every worker continues from

    θ_{w,f} ← θ_f' + (θ_{w,f}(c+τ) − θ_{w,f}(c)),

the synchronized fragment plus its own progress since the snapshot: no inner step is lost, and the next
Δ_{w,f} = θ_f' − θ_{w,f} counts those τ steps. τ = 0 (blocking): θ_{w,f} ← θ_f' exactly.

Over torch.distributed with τ > 0 the exchanges run on one background thread over a second process group
of the same ranks (issued in the same order on every rank, so its collectives match), while the inner
steps and their small collectives stay on the first; in the simulation (and with τ = 0) an exchange runs
when it is issued and its result waits for its step. Both compute the same numbers: the exchange depends
only on the snapshot and the fragment's state, and each fragment's exchanges are H > τ steps apart.
"""

from __future__ import annotations

import abc
import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dqsgd.core.rng import QUANT, seed_for
from dqsgd.method.config import MethodConfig
from dqsgd.method.pipeline import Method, MethodState
from dqsgd.policies import state_from_dict, state_to_dict
from dqsgd.topology.agreement import check_residuals, shard_lengths
from dqsgd.topology.downspec import DownlinkSpec
from dqsgd.topology.sparse import local_step_for
from dqsgd.topology.step import StepOutcome
from dqsgd.train.local import copy_into
from dqsgd.train.schedule import check_streaming, due, exchanges, offsets, split

__all__ = ["Exchanger", "Fragment", "Pending", "Streaming", "build_fragments", "merge"]


@dataclass
class Fragment:
    """One fragment: tensors [lo, hi) = coordinates [a, b) of the flat vector, its offset in the period,
    its method, step object and state, its exchanges issued (``done``) and its last snapshot's step."""

    index: int
    lo: int
    hi: int
    a: int
    b: int
    offset: int
    method: Method
    runner: Any
    state: MethodState
    done: int = 0
    last: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "last": self.last, "state": method_state_dict(self.state)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.done, self.last = int(sd["done"]), int(sd["last"])
        self.state = self.method_state(sd["state"])

    def method_state(self, sd: dict[str, Any]) -> MethodState:
        policy = None if sd["policy"] is None else state_from_dict(type(self.runner.policy.init()), sd["policy"])
        residuals = [sd["residuals"].get(w) for w in range(len(self.state.residuals))]
        fed = {int(j): r for j, r in sd["down"].items()}
        return MethodState(policy, residuals, down_residuals=fed) if policy is not None else \
            MethodState(None, residuals, int(sd["bits"]), fed)

    def budget_bits(self, auto: bool) -> int | None:
        return int(self.runner.policy.budget_bits) if auto else self.method.budget_bits()


def method_state_dict(s: MethodState) -> dict[str, Any]:
    return {"policy": None if s.policy is None else state_to_dict(s.policy), "bits": s.bits,
            "residuals": {int(w): r for w, r in enumerate(s.residuals) if r is not None},
            "down": {int(j): r for j, r in s.down_residuals.items()}}


def build_fragments(config: MethodConfig, sizes: list[int], count: int, local_steps: int, steps: int, topology: str,
                    workers: int, seed: int, downlink: DownlinkSpec) -> list[Fragment]:
    """The F fragments of a model of tensor ``sizes``: fragment f's method over its coordinates, planned over
    its own exchanges; an explicit ``budget_bits`` shared out by coordinates (the shares sum to at most it);
    fragment 0 quantizes with the run's ``seed``, fragment f > 0 with a seed of its own."""
    total, out, a = sum(sizes), [], 0
    for f, ((lo, hi), offset) in enumerate(zip(split(sizes, count), offsets(local_steps, count))):
        part = sizes[lo:hi]
        n = sum(part)
        cfg = config if not config.budget_bits or count == 1 else \
            dataclasses.replace(config, budget_bits=config.budget_bits * n // total)
        method = Method(cfg, n, exchanges(steps, local_steps, offset), part)
        runner = local_step_for(method, topology, part, workers, seed if f == 0 else seed_for(seed, QUANT, 1 << 20, f),
                                downlink)
        out.append(Fragment(f, lo, hi, a, a + n, offset, method, runner, method.init_state(workers, runner.policy)))
        a += n
    return out


def merge(local: torch.Tensor, snapshot: torch.Tensor | None, synced: torch.Tensor) -> torch.Tensor:
    """A worker's fragment after its exchange completes: ``synced`` plus the progress since ``snapshot``
    (None: no step since, τ = 0: ``synced`` itself)."""
    return synced.clone() if snapshot is None else synced + (local - snapshot)


@dataclass
class Pending:
    """An exchange in flight: issued after step ``issued`` (its snapshots, per local worker, when τ > 0),
    as the fragment's ``index``-th exchange and the run's ``serial``-th; ``ready_s``: the simulated time
    it could start."""

    frag: Fragment
    issued: int
    index: int
    serial: int
    snapshot: dict[int, torch.Tensor] | None
    future: Future
    ready_s: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        """Waits for the exchange's result (its bytes are on the wire already) and holds it, not applied."""
        out: StepOutcome | None = self.future.result()
        return {"frag": self.frag.index, "issued": self.issued, "index": self.index, "serial": self.serial,
                "snapshot": self.snapshot, "ready_s": self.ready_s,
                "outcome": None if out is None else {**{k: getattr(out, k) for k in OUTCOME},
                                                     "state": method_state_dict(out.state)}}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, sd: dict[str, Any], frags: list[Fragment]) -> Pending:
        frag = frags[int(sd["frag"])]
        o = sd["outcome"]
        out = None if o is None else StepOutcome(**{k: o[k] for k in OUTCOME}, residuals={},
                                                 state=frag.method_state(o["state"]))
        fut: Future = Future()
        fut.set_result(out)
        return cls(frag, int(sd["issued"]), int(sd["index"]), int(sd["serial"]), sd["snapshot"], fut, float(sd["ready_s"]))


OUTCOME = ("update", "up", "down", "side", "encode_s", "coded", "coded_s", "topology")


class Exchanger:
    """Runs the exchanges: at once (the simulation, or τ = 0), or on one background thread over a second
    process group of the same ranks (torch.distributed with τ > 0)."""

    def __init__(self, transport: Any, overlap: int):
        self.transport, self.pool = transport, None
        if overlap and hasattr(transport, "backend"):  # a torch.distributed transport
            import torch.distributed as dist

            from dqsgd.transport.torch_dist import make_transport

            ranks = None if transport.group is None else dist.get_process_group_ranks(transport.group)
            # only the group's ranks take part (a subgroup's peers need not construct anything)
            group = dist.new_group(ranks=ranks, backend=transport.backend, use_local_synchronization=ranks is not None)
            timeout = None if transport.timeout is None else transport.timeout.total_seconds()
            self.transport = make_transport(transport.topology, group, transport.device, timeout)
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="dqsgd-exchange")

    def submit(self, job: Callable[[Any], Any]) -> Future:
        """``job(transport)``, on the exchange thread or here."""
        if self.pool is not None:
            return self.pool.submit(job, self.transport)
        fut: Future = Future()
        try:
            fut.set_result(job(self.transport))
        except Exception as e:  # delivered where the result is taken, as from the thread
            fut.set_exception(e)
        return fut

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class Streaming(abc.ABC):
    """The schedule over a host's workers (the trainer's rounds, or one process's model): issue the due
    exchanges, complete them τ steps later, apply the outer step per fragment and merge."""

    frags: list[Fragment]
    local_steps: int
    overlap: int
    exchanger: Exchanger
    pending: list[Pending]
    start: torch.Tensor  # the synchronized parameters θ, flat
    serial: int          # exchanges issued so far, all fragments

    @abc.abstractmethod
    def locals_of(self, frag: Fragment) -> dict[int, torch.Tensor]:
        """Every local worker's fragment now (copies)."""

    @abc.abstractmethod
    def set_local(self, frag: Fragment, worker: int, value: torch.Tensor) -> None:
        """Worker ``worker``'s fragment := ``value``."""

    @abc.abstractmethod
    def job(self, frag: Fragment, vectors: dict[int, torch.Tensor], index: int, serial: int) -> Callable[[Any], Any]:
        """The exchange of ``vectors`` as a function of the transport it runs over (None: skipped)."""

    @abc.abstractmethod
    def finish(self, p: Pending, out: StepOutcome | None) -> Any:
        """Apply a completed exchange (:meth:`apply`) and account for it."""

    def ready_s(self) -> float:
        return 0.0

    def advance(self, c: int, last: bool) -> list[Any]:
        """After the ``c``-th inner step: issue the due exchanges, complete those issued τ steps ago; at the
        run's ``last`` step complete all and exchange every fragment that progressed since its snapshot."""
        for fr in self.frags:
            if due(c, self.local_steps, fr.offset):
                self.issue(fr, c)
        if not last:
            return self.complete(lambda p: p.issued + self.overlap <= c)
        out = self.complete(lambda p: True)
        for fr in self.frags:
            if fr.last < c:
                self.issue(fr, c)
                out += self.complete(lambda p: True)
        return out

    def issue(self, fr: Fragment, c: int) -> None:
        cur = self.locals_of(fr)
        theta = self.start[fr.a: fr.b]
        vectors = {w: theta - v for w, v in cur.items()}
        index, serial = fr.done, self.serial
        fr.done, fr.last, self.serial = fr.done + 1, c, self.serial + 1
        fut = self.exchanger.submit(self.job(fr, vectors, index, serial))
        self.pending.append(Pending(fr, c, index, serial, cur if self.overlap else None, fut, self.ready_s()))

    def complete(self, when: Callable[[Pending], bool]) -> list[Any]:
        out = []
        while self.pending and when(self.pending[0]):
            p = self.pending.pop(0)
            out.append(self.finish(p, p.future.result()))
        return out

    def apply(self, p: Pending, update: torch.Tensor, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
              lr: float | None = None) -> None:
        """The outer step on the fragment's parameters alone (from θ_f), θ_f := θ_f', and the merge."""
        fr = p.frag
        cur = self.locals_of(fr)
        mine = params[fr.lo: fr.hi]
        copy_into(mine, self.start[fr.a: fr.b])
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        for q in params:
            q.grad = None
        offset = 0
        for q in mine:
            q.grad = update[offset: offset + q.numel()].view_as(q).to(q.device, q.dtype)
            offset += q.numel()
        optimizer.step()
        for q in mine:
            q.grad = None
        self.start[fr.a: fr.b] = torch.cat([q.detach().reshape(-1) for q in mine]).to(self.start.device)
        synced = self.start[fr.a: fr.b]
        for w, v in cur.items():
            self.set_local(fr, w, merge(v, None if p.snapshot is None else p.snapshot[w], synced))

    def streaming_state(self) -> dict[str, Any]:
        return {"frags": [fr.state_dict() for fr in self.frags], "pending": [p.state_dict() for p in self.pending],
                "serial": self.serial}

    def check_streaming_state(self, sd: dict[str, Any]) -> None:
        """Raise a ValueError, before anything is loaded, if ``sd`` holds another number of fragments or a
        fragment's error-fed downlink residuals do not fit its shards."""
        if len(sd["frags"]) != len(self.frags):
            raise ValueError(f"the state holds {len(sd['frags'])} fragments, this run has {len(self.frags)}")
        for fr, st in zip(self.frags, sd["frags"]):
            check_residuals(st["state"]["down"], shard_lengths(fr.runner), f"fragment {fr.index}'s state", "down")

    def load_streaming_state(self, sd: dict[str, Any]) -> None:
        self.check_streaming_state(sd)
        for fr, st in zip(self.frags, sd["frags"]):
            fr.load_state_dict(st)
        self.pending = [Pending.from_dict(p, self.frags) for p in sd["pending"]]
        self.serial = int(sd["serial"])
