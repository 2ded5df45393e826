"""Local SGD in the trainer: rounds of H inner steps per worker, then one exchange of pseudo-gradients.

A round r that starts from the synchronized model θ_r:

1. every worker w takes H inner steps of its own optimizer (SGD with momentum, or AdamW) on its own
   minibatches, from θ_r to θ_w (the minibatch of inner step n is the one the per-step run draws at
   step n: ``WorkerBatches.indices(w, n)``);
2. its pseudo-gradient Δ_w = θ_r − θ_w goes through the run's step object exactly as a gradient
   does (:meth:`dqsgd.topology.step.ExchangeStep.run`, with the round
   index r as the step: quantization keys, error feedback, the bit policy's width B_r), which returns
   the decoded average Δ̂ = (1/W) Σ_w Q(Δ_w), the same on every rank;
3. the outer optimizer treats Δ̂ as a gradient: θ_{r+1} = θ_r − η_out·Δ̂ (outer SGD; lr 1 and no
   momentum is plain model averaging), or Nesterov momentum m ← μ·m + Δ̂, θ_{r+1} = θ_r − η_out·(Δ̂ + μ·m)
   (DiLoCo's outer step);
4. every worker restarts from θ_{r+1}; its inner optimizer keeps its state (momentum, Adam moments).

The bit policy therefore sees one aggregate per round: its step count is the number of rounds, its
norm statistics are those of Δ̂, and a budgeted policy spreads its budget over the rounds.

The period: fixed (H = ``local_steps``; the last round is cut at ``steps``), or adaptive: the first
round has H_0 = ``local_steps`` and round r+1 has H = clamp(⌈H_0·√(L_r / L_0)⌉, ``local_steps_min``,
H_0), L_r being the mean training loss over round r's inner steps (the same on every rank). Few
exchanges while the loss is far above its floor, more as it approaches it (docs/local-sgd.md).

Every process holds the synchronized model in the trainer's ``model`` (what is evaluated and
checkpointed) and, for each of its local workers, that worker's parameters and inner optimizer.
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol

import torch

from dqsgd.core.ranges import check_outer
from dqsgd.method.pipeline import MethodState
from dqsgd.topology.links import Transport
from dqsgd.train.config import TrainConfig
from dqsgd.train.metrics import StepResult
from dqsgd.train.slownodes import StepTimer

__all__ = ["LocalRounds", "RoundHost", "inner_optimizer", "outer_optimizer"]


class RoundHost(Protocol):
    """What the rounds use of the trainer that runs them (:class:`dqsgd.train.trainer.Trainer`)."""

    cfg: TrainConfig
    model: torch.nn.Module
    params: list[torch.Tensor]
    device: torch.device
    lr: float
    next_step: int
    state: MethodState
    timer: StepTimer
    transport: Transport
    # what the streaming rounds (dqsgd.train.streaming) also use
    entry: Any
    seed: int
    topology: str
    downlink: Any
    ledger: Any
    skipped: int
    optimizer: torch.optim.Optimizer
    qgen: dict[int, torch.Generator]
    # what the rounds of a sparse method (dqsgd.topology.sparse) replace: its own step object and policy
    method: Any
    step_runner: Any
    policy: Any

    def measures_coded(self, step: int) -> bool: ...

    def gather_coded(self, local: dict[int, int]) -> list[int]: ...

    def flat_params(self) -> torch.Tensor: ...

    def lr_at(self, step: int) -> float: ...

    def worker_gradient(self, worker: int, step: int, l2: bool = True) -> tuple[torch.Tensor, float]: ...

    def communicate(self, vectors: dict[int, torch.Tensor], n: int, index: int, lr: float, losses: list[float],
                    compute_s: float, compute_steps: int = 1) -> StepResult: ...


def outer_optimizer(params: list[torch.Tensor], kind: str, lr: float, momentum: float) -> torch.optim.Optimizer:
    """The optimizer that applies the averaged pseudo-gradient to the synchronized model: ``kind``
    "sgd" (lr 1, no momentum: plain averaging) or "nesterov" (DiLoCo's outer step)."""
    kind, lr, momentum = check_outer(kind, lr, momentum)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=kind == "nesterov")


def inner_optimizer(cfg: TrainConfig, lr: float, momentum: float, vector: torch.Tensor) -> torch.optim.Optimizer:
    """One worker's optimizer over its flat parameter vector (elementwise, so flat = per tensor)."""
    if cfg.inner_optimizer == "adamw":
        return torch.optim.AdamW([vector], lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD([vector], lr=lr, momentum=momentum)


def copy_into(params: list[torch.Tensor], vector: torch.Tensor) -> None:
    """The model's parameters := the flat ``vector`` (copied: nothing aliases it)."""
    with torch.no_grad():
        offset = 0
        for p in params:
            n = p.numel()
            p.copy_(vector[offset: offset + n].view_as(p))
            offset += n


class Period:
    """The length of each round: fixed, or adaptive (shrinking with the round's loss, module docstring)."""

    def __init__(self, cfg: TrainConfig):
        self.h0, self.h_min, self.adaptive = cfg.local_steps, cfg.local_steps_min, cfg.local_period == "adaptive"
        self.first_loss: float | None = None

    def next(self, round_loss: float) -> int:
        """H of the next round, after a round whose mean training loss was ``round_loss``."""
        if not self.adaptive:
            return self.h0
        if self.first_loss is None:
            self.first_loss = round_loss
        if not (math.isfinite(round_loss) and self.first_loss > 0 and math.isfinite(self.first_loss)):
            return self.h0
        h = math.ceil(self.h0 * math.sqrt(max(round_loss, 0.0) / self.first_loss))
        return min(self.h0, max(self.h_min, h))


class LocalRounds:
    """The trainer's step in rounds: :meth:`step` is one inner step, and the exchange at a round's end."""

    def __init__(self, tr: RoundHost, momentum: float):
        buffers = [n for n, _ in tr.model.named_buffers()][:3]
        if buffers:  # one process runs several workers on one module: their statistics would mix
            raise ValueError(f"Local SGD: model {tr.cfg.model!r} has buffers ({', '.join(buffers)}, ...: BatchNorm "
                             f"statistics), which the workers would share in the simulation; use a model without")
        self.tr, self.cfg = tr, tr.cfg
        self.period = Period(tr.cfg)
        self.start = tr.flat_params().to(tr.device)
        self.local = {w: self.start.clone() for w in tr.transport.local_workers}
        self.inner = {w: inner_optimizer(tr.cfg, tr.lr, momentum, v) for w, v in self.local.items()}
        self.round, self.round_begin, self.round_end = 0, 0, min(tr.cfg.steps, self.period.h0)
        self.loss_sum, self.loss_count = 0.0, 0

    def inner_step(self, n: int, lr: float) -> list[float]:
        """Every local worker's inner step ``n`` from its own parameters; the model is left at θ_r."""
        tr, losses = self.tr, []
        for w, vector in self.local.items():
            copy_into(tr.params, vector)
            grad, loss = tr.worker_gradient(w, n, l2=self.cfg.inner_optimizer != "adamw")
            opt = self.inner[w]
            opt.param_groups[0]["lr"] = lr
            vector.grad = grad.to(vector.dtype)
            opt.step()
            vector.grad = None
            losses.append(loss)
        copy_into(tr.params, self.start)
        return losses

    def timed_inner_step(self) -> tuple[int, float, list[float], float]:
        """The next inner step: (its index n, its lr, the local workers' losses, the seconds it took)."""
        n = self.tr.next_step
        lr = self.tr.lr_at(n)
        t0 = time.perf_counter()
        losses = self.inner_step(n, lr)
        return n, lr, losses, time.perf_counter() - t0

    def step(self) -> StepResult:
        tr = self.tr
        n, lr, losses, compute_s = self.timed_inner_step()
        if n + 1 < self.round_end:
            loss = tr.transport.mean_loss(losses)
            self.note_loss(loss)
            return StepResult(n, loss, lr, tr.state.bits, False, [], 0, 0, compute_s, 0.0, 0.0,
                              sim_time_s=tr.timer.elapsed)  # the simulated clock moves at the round's exchange
        deltas = {w: self.start - v for w, v in self.local.items()}
        res = tr.communicate(deltas, n, self.round, self.cfg.outer_lr, losses, compute_s, n + 1 - self.round_begin)
        res.lr = lr
        self.note_loss(res.loss)
        self.end_round(n)
        return res

    def note_loss(self, loss: float) -> None:
        if math.isfinite(loss):
            self.loss_sum, self.loss_count = self.loss_sum + loss, self.loss_count + 1

    def end_round(self, n: int) -> None:
        """After round r's exchange (or its skip): every worker restarts from the model; the next round's length."""
        self.start = self.tr.flat_params().to(self.tr.device)
        for v in self.local.values():
            v.copy_(self.start)
        mean = self.loss_sum / self.loss_count if self.loss_count else float("nan")
        self.round, self.round_begin = self.round + 1, n + 1
        self.round_end = min(self.cfg.steps, n + 1 + self.period.next(mean))
        self.loss_sum, self.loss_count = 0.0, 0

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "start": self.start.clone(),
            "local": {int(w): v.clone() for w, v in self.local.items()},
            "inner": {int(w): opt.state_dict() for w, opt in self.inner.items()},
            "round": self.round, "round_begin": self.round_begin, "round_end": self.round_end,
            "loss_sum": self.loss_sum, "loss_count": self.loss_count, "first_loss": self.period.first_loss,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sorted(int(w) for w in sd["local"]) != sorted(self.local):
            raise ValueError(f"the Local SGD state holds workers {sorted(sd['local'])}, this process runs {sorted(self.local)}")
        self.start = sd["start"].to(self.tr.device).clone()
        for w, v in sd["local"].items():
            self.local[int(w)].copy_(v)
        for w, st in sd["inner"].items():
            self.inner[int(w)].load_state_dict(st)
        self.round, self.round_begin, self.round_end = int(sd["round"]), int(sd["round_begin"]), int(sd["round_end"])
        self.loss_sum, self.loss_count = float(sd["loss_sum"]), int(sd["loss_count"])
        self.period.first_loss = None if sd["first_loss"] is None else float(sd["first_loss"])
