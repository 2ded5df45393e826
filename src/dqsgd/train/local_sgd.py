"""Local SGD with compressed pseudo-gradients for your own training loop (torch.distributed).

:class:`LocalSGDOptimizer` wraps your optimizer and model, in the manner of PyTorch's
``PostLocalSGDOptimizer``: every process trains its own copy of the model with your optimizer; every
``local_steps`` = H calls of :meth:`~LocalSGDOptimizer.step`, the pseudo-gradient Δ = θ_start − θ of
each process is quantized by a dqsgd method, exchanged over the sharded collective (the transport and
step object of ``dqsgd train --transport torch``: :class:`dqsgd.topology.step.ShardedStep`), and the decoded
average Δ̂ — the same on every rank — is applied to θ_start by an outer optimizer (SGD with lr 1 and
no momentum = model averaging; Nesterov momentum as DiLoCo). Every process then continues from the
new θ_start; your optimizer keeps its state. See docs/local-sgd.md.

    dist.init_process_group("gloo")                       # e.g. under torchrun
    model = Net()                                         # the same seeded init on every rank
    opt = LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                            local_steps=16, method="qsgd-4bit")
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()                                        # every 16th call also exchanges Δ

Do not wrap the model in DistributedDataParallel: it would all-reduce every step's gradients.
At the first exchange the ranks all-gather a fingerprint of (H, method, model size, topology, outer
step, seed) and every rank refuses a difference with :class:`~dqsgd.transport.torch_dist.RankDisagreement`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from dqsgd.core.rng import QUANT, generator
from dqsgd.method.config import MethodConfig, method_config
from dqsgd.method.pipeline import Method, MethodState
from dqsgd.policies import state_from_dict, state_to_dict
from dqsgd.topology.agreement import digest
from dqsgd.topology.downlink import resolve_downlink_coding
from dqsgd.topology.downspec import DownlinkSpec
from dqsgd.topology.step import all_finite, step_for
from dqsgd.train.local import copy_into, outer_optimizer
from dqsgd.transport.torch_dist import RankDisagreement, make_transport

__all__ = ["LocalSGDOptimizer"]

FORMAT = 1
FINGERPRINT = ("local_steps", "method", "numel", "exchange")  # what the ranks must agree on
NO_HORIZON = ("fixed", "adaptive", "adaqs")  # bit policies that do not plan over the number of rounds


class LocalSGDOptimizer:
    """``optimizer`` (over ``model``'s parameters) with a compressed Local SGD exchange every
    ``local_steps`` steps; see the module docstring.

    ``method``: a dqsgd method name or config (``method_options`` are passed to
    :func:`dqsgd.method.config.method_config`); ``rounds``: how many exchanges the run will have (needed by
    the bit policies that plan over the run: DQSGD's rules and budgets); ``outer``: "sgd" | "nesterov"
    with ``outer_lr`` and ``outer_momentum``; ``topology``: "sharded" (default), "allgather" or "ps";
    ``downlink_bits``: the sharded downlink's width (32 = fp32); ``downlink_coding``: its coding
    (None: the method's uplink coding, :mod:`dqsgd.topology.downlink`); ``seed``: the quantization streams'
    seed; ``group``/``timeout``: the process group and the per-collective timeout in seconds.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, local_steps: int,
                 method: str | MethodConfig = "qsgd-4bit", *, rounds: int | None = None, outer: str = "sgd",
                 outer_lr: float = 1.0, outer_momentum: float = 0.0, topology: str = "sharded",
                 downlink_bits: int = 8, seed: int = 0, group: Any = None, timeout: float | None = None,
                 downlink_coding: str | None = None, **method_options: Any):
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"local_steps must be an integer >= 1, got {local_steps!r}")
        config = method if isinstance(method, MethodConfig) else method_config(method, **method_options)
        if rounds is None and config.policy not in NO_HORIZON:
            raise ValueError(f"method {config.name!r} (policy {config.policy!r}) plans over the run: pass rounds=, "
                             f"the number of exchanges (steps // local_steps)")
        self.optimizer, self.local_steps = optimizer, local_steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        sizes = [p.numel() for p in self.params]
        self.method = Method(config, sum(sizes), rounds or 1, sizes)
        self.transport = make_transport(topology, group, timeout=timeout)
        self.rank, self.workers = self.transport.rank, self.transport.workers
        downlink = DownlinkSpec(downlink_bits, resolve_downlink_coding(
            downlink_coding, uplink_coding=config.coding, bits=downlink_bits, vote=config.aggregate == "majority",
            topology=topology))
        self.step_runner = step_for(self.method, topology, sizes, self.workers, seed, downlink)
        self.outer = outer_optimizer(self.params, outer, outer_lr, outer_momentum)
        self.state = self.method.init_state(self.workers, self.step_runner.policy)
        self.qgen = {self.rank: generator(seed, QUANT, self.rank)}
        self.fingerprint = [local_steps, digest(dataclasses.asdict(config)), sum(sizes),
                            digest([topology, downlink_bits, outer, outer_lr, outer_momentum, seed, rounds]
                                   + ([] if downlink_coding is None else [downlink_coding]))]
        self.start = self._flat()
        self.steps, self.rounds_done, self.checked = 0, 0, False
        self.link_bytes = 0  # bytes this rank sent and received in the exchanges (uplink and downlink phases)

    # --- the optimizer interface ----------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Your optimizer's step; after every ``local_steps``-th, the exchange and the outer step."""
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.steps += 1
        if self.steps % self.local_steps == 0:
            self.sync()
        return loss

    # --- the exchange ---------------------------------------------------------------------------
    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params]).clone()

    def check_agreement(self) -> None:
        """All-gather the fingerprint; every rank raises at once, naming what differs, if any does."""
        rows = self.transport.all_gather_ints(self.fingerprint)
        bad = [name for i, name in enumerate(FINGERPRINT) if any(r[i] != rows[0][i] for r in rows)]
        if bad:
            shown = "; ".join(f"{name}: " + ", ".join(f"rank {r} {row[i] if name in ('local_steps', 'numel') else '#%x' % row[i]}"
                                                       for r, row in enumerate(rows))
                              for i, name in enumerate(FINGERPRINT) if name in bad)
            raise RankDisagreement(f"rank {self.rank}: the ranks' LocalSGDOptimizer settings differ in "
                                   f"{', '.join(bad)} ({shown}); every rank must use the same")
        self.checked = True

    def sync(self) -> None:
        """Exchange this round's compressed Δ and apply the outer step (every rank: the same model)."""
        t = self.transport
        with t.guard():
            if not self.checked:
                self.check_agreement()
            delta = {self.rank: (self.start - self._flat()).cpu()}
            all_finite(t, delta, self.rounds_done, "raise")
            ex = self.step_runner.run(t, delta, self.state, self.rounds_done, self.qgen)  # type: ignore[arg-type]
        assert ex.state is not None
        self.state = ex.state
        up, down = ex.wire() if ex.up else ([0] * self.workers, [0] * self.workers)
        self.link_bytes += up[self.rank] + down[self.rank]
        copy_into(self.params, self.start)
        offset = 0
        for p in self.params:
            p.grad = ex.update[offset: offset + p.numel()].view_as(p).to(p.device, p.dtype)
            offset += p.numel()
        self.outer.step()
        for p in self.params:
            p.grad = None
        self.start = self._flat()
        self.rounds_done += 1

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything to continue exactly, the model's current parameters included."""
        policy = self.state.policy
        return {
            "format": FORMAT, "fingerprint": list(self.fingerprint), "rank": self.rank,
            "optimizer": self.optimizer.state_dict(), "outer": self.outer.state_dict(),
            "params": self._flat().cpu(), "start": self.start.cpu(),
            "steps": self.steps, "rounds_done": self.rounds_done,
            "policy": None if policy is None else state_to_dict(policy), "bits": self.state.bits,
            "residual": self.state.residuals[self.rank], "qgen": self.qgen[self.rank].get_state(),
            "link_bytes": self.link_bytes,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("format") != FORMAT:
            raise ValueError(f"not a LocalSGDOptimizer state of format {FORMAT} (format {sd.get('format')!r})")
        if list(sd["fingerprint"]) != self.fingerprint or sd["rank"] != self.rank:
            raise ValueError(f"the state is of another setting or rank (fingerprint {sd['fingerprint']}, rank "
                             f"{sd['rank']}); this is {self.fingerprint}, rank {self.rank}")
        self.optimizer.load_state_dict(sd["optimizer"])
        self.outer.load_state_dict(sd["outer"])
        copy_into(self.params, sd["params"].to(self.params[0].device))
        self.start = sd["start"].to(self.params[0].device).clone()
        self.steps, self.rounds_done = int(sd["steps"]), int(sd["rounds_done"])  # the ranks agree again at the next exchange
        residuals = [None] * self.workers
        residuals[self.rank] = sd["residual"]
        policy = None if sd["policy"] is None else state_from_dict(type(self.step_runner.policy.init()), sd["policy"])
        self.state = MethodState(policy, residuals, -1 if policy is not None else int(sd["bits"]))
        self.qgen[self.rank].set_state(sd["qgen"])
        self.link_bytes = int(sd["link_bytes"])
