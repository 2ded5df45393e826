"""The training loop: data → gradient per worker → the topology's step → update (DQSGD Algorithm 2).

One step, the same for every topology and transport:

1. every local worker w draws its minibatch (a pure function of seed, w, n) and computes g_w;
2. the step object of the topology (:class:`~dqsgd.topology.step.ExchangeStep`: one exchange of the
   topology, :mod:`dqsgd.topology.exchange`) checks the gradients, encodes them at the current width
   B_n, exchanges them, aggregates, lets the policy pick B_{n+1} and decodes the update;
3. the aggregating process records the measured bytes in the ledger;
4. every process applies the same optimizer step.

On the steps n with n % ``train.coded_every`` == 0, every process also measures the uplink it sends
with the best coding (:meth:`dqsgd.method.pipeline.Method.coded_size` of each local worker's payload, or
the sum over its W shard payloads), and the sizes are all-gathered (``Transport.all_gather_ints``)
so that every ledger records the same W numbers. Nothing sent changes: the model and the widths
are the same with or without the measurement.

Everything that decides the rest of a run is in :meth:`Trainer.state_dict` (loaded back by
:meth:`Trainer.load_state_dict`); :mod:`dqsgd.train.checkpoint` writes and reads it as files.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from dqsgd.data import Dataset
from dqsgd.topology.ledger import Ledger
from dqsgd.topology.registry import SIMULATED_DEFAULT, run_topology, topology_of
from dqsgd.method.config import MethodConfig, check_fed_policy
from dqsgd.method.pipeline import Method, MethodState
from dqsgd.models import build_model
from dqsgd.policies import state_from_dict, state_to_dict
from dqsgd.policies.variance import worker_norms
from dqsgd.topology.agreement import check_residuals, check_state, refuse_changed, shard_lengths
from dqsgd.topology.sketched import SketchedStep
from dqsgd.topology.downspec import BEFORE
from dqsgd.topology.step import ExchangeStep, all_finite, codec_input, step_for
from dqsgd.train.config import MethodEntry, TrainConfig, resolve_downlink
from dqsgd.train.local import outer_optimizer
from dqsgd.train.metrics import StepResult
from dqsgd.train.sampling import MODEL_INIT, QUANT, WorkerBatches, generator, partition_shards, seed_for
from dqsgd.train.slownodes import SlowNodes, StepTimer, check_backup, check_backup_processes
from dqsgd.train.streaming import rounds_for
from dqsgd.transport import SimTransport, Transport


STATE_FORMAT = 2  # the layout of Trainer.state_dict (and of checkpoint files)

_STATE_KEYS = {"meta": dict, "next_step": int, "skipped": int, "model": dict, "optimizer": dict, "policy": (dict, None),
               "residuals": dict, "qgen": dict, "bits": int, "ledger": (dict, None)}

__all__ = ["STATE_FORMAT", "StepResult", "Trainer", "codec_input", "record_of"]


def measured_link(config: MethodConfig, transport: Transport) -> MethodConfig:
    """The config a link policy with ``link_mbit`` 0 runs over processes (opt-in: ``dqsgd-link`` with
    ``link_mbit`` 0): on the link the transport's exchange group measures,
    :func:`~dqsgd.policies.linktime.measure_link`, the same figures on every rank; every other config as
    it is. The entry (and so the run's record and checkpoint) keeps ``link_mbit`` 0: a resumed run
    measures the link again."""
    if config.policy != "link" or config.link_mbit:
        return config
    from dqsgd.policies.linktime import measure_link, on_measured

    groups = transport.exchange_groups()  # type: ignore[attr-defined]
    return on_measured(config, (*measure_link(next(iter(groups.values()))), 1.0))  # the link only: codec as modelled


class Trainer:
    """One method, one seed, one (local part of a) run."""

    def __init__(self, cfg: TrainConfig, entry: MethodEntry, data: Dataset, seed: int,
                 transport: Transport | None = None, device: torch.device | str = "cpu"):
        cfg = entry.train_config(cfg)  # the method's own Local SGD keys, if it sets any
        self.cfg, self.entry, self.data, self.seed = cfg, entry, data, seed
        self.transport = transport or SimTransport(cfg.workers, run_topology(cfg.topology, processes=False))
        if self.transport.workers != cfg.workers:
            raise ValueError(f"transport has {self.transport.workers} workers, config says {cfg.workers}")
        self.topology = str(getattr(self.transport, "topology", SIMULATED_DEFAULT))
        if cfg.topology and cfg.topology != self.topology:
            raise ValueError(f"train.topology = {cfg.topology!r} but the transport is {self.topology!r}")
        self.device = torch.device(device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_for(seed, MODEL_INIT))
            self.model = build_model(cfg.model, data).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        sizes = [p.numel() for p in self.params]
        self.numel = sum(sizes)
        if self.numel == 0:
            raise ValueError(f"model {cfg.model!r} has no trainable parameters: nothing to train or send")
        self.lr = entry.lr if entry.lr is not None else cfg.lr
        momentum = entry.optimizer_momentum(cfg)
        if momentum and entry.config.scheme == "sketch" and entry.config.sketch_momentum:
            raise ValueError(f"method {entry.label!r}: Sketched SGD keeps its momentum on the workers "
                             f"(sketch_momentum = {entry.config.sketch_momentum}); methods.{entry.label}.momentum = "
                             f"{momentum} would add a second one: leave it unset (or 0.0), or set sketch_momentum = 0")
        # Local SGD: this optimizer is the outer one, on the averaged pseudo-gradient (dqsgd.train.local)
        self.optimizer = (outer_optimizer(self.params, cfg.outer_optimizer, cfg.outer_lr, cfg.outer_momentum)
                          if cfg.local else torch.optim.SGD(self.params, lr=self.lr, momentum=momentum))
        processes, config = len(self.transport.local_workers) != cfg.workers, entry.config
        if processes and topology_of(self.topology).feeds_norms and not cfg.local:  # a link to measure
            config = measured_link(config, self.transport)
        # hand_worker_norms needs every worker's vector; the exchange of a topology that feeds them gathers their norms itself
        if processes and not topology_of(self.topology).feeds_norms:
            check_fed_policy(entry.config, f"a run over processes (--transport torch) on topology {self.topology!r}")
        self.method = Method(config, self.numel, cfg.rounds, sizes)  # the policy counts exchanges
        shards = partition_shards(cfg.partition, data.train.y, cfg.workers, cfg.dirichlet_alpha, cfg.batch_size, seed)
        self.batches = WorkerBatches(len(data.train.y), cfg.workers, cfg.batch_size, seed, shards)
        self.qgen = {w: generator(seed, QUANT, w) for w in self.transport.local_workers}
        # kernel "fused": uniforms are a pure function of (seed, step, worker) — no state to checkpoint.
        self.quant_seed = seed_for(seed, QUANT)
        # the downlink, resolved once from the config (dqsgd.topology.downspec) and carried as it is
        self.downlink = resolve_downlink(cfg, entry.config, self.topology)
        self.downlink_bits = self.downlink.bits
        self.step_runner: ExchangeStep | SketchedStep = (
            SketchedStep(self.method, seed, self.topology, cfg.workers) if entry.config.scheme == "sketch"
            else step_for(self.method, self.topology, sizes, cfg.workers, seed, self.downlink))
        self.policy = self.step_runner.policy  # "auto": the sharded protocol's both-leg split of the budget
        self.state: MethodState = self.method.init_state(cfg.workers, self.policy)
        self.ledger = Ledger(self.numel, cfg.workers, self.budget_bits(), topology=self.topology,
                             both_legs=self.downlink.auto)
        self._vmapped = self._vmap_gradients() if cfg.vmap_workers else None
        if cfg.backup_workers:
            check_backup(entry.config)
            check_backup_processes(cfg, self.transport, self.method.total_steps)
        self.timer = StepTimer(SlowNodes(cfg), seed, cfg.workers, self.transport, cfg.backup_workers,
                               getattr(self.step_runner, "rounds", 2))
        self.next_step = 0
        self.skipped = 0
        self.local = rounds_for(self, momentum) if cfg.local else None

    def budget_bits(self) -> int | None:
        """The budget the ledger charges: the method's uplink budget, or under ``downlink_bits = "auto"``
        the both-leg budget of its split policy (:mod:`dqsgd.policies.split`)."""
        auto = self.downlink.auto and hasattr(self.policy, "budget_bits")  # not the link policy's own choice
        return int(self.policy.budget_bits) if auto else self.method.budget_bits()

    # --- pieces of a step -----------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        if self.cfg.lr_schedule == "cosine":
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * step / self.cfg.steps))
        return self.lr

    def worker_gradient(self, worker: int, step: int, l2: bool = True) -> tuple[torch.Tensor, float]:
        """Worker ``worker``'s flat gradient at step ``step`` and its loss; ``l2``: with the
        ``weight_decay`` term (AdamW inside Local SGD decays the weights itself instead)."""
        idx = self.batches.indices(worker, step)
        x = self.data.train.x[idx].to(self.device)
        y = self.data.train.y[idx].to(self.device)
        self.model.train()
        loss = F.cross_entropy(self.model(x), y)
        grads = torch.autograd.grad(loss, self.params)
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.cfg.weight_decay and l2:
            flat = flat + self.cfg.weight_decay * torch.cat([p.detach().reshape(-1) for p in self.params])
        return flat, float(loss.detach())

    def _vmap_gradients(self) -> Any:
        """``(params, X[W, B, ...], Y[W, B]) -> (grads per parameter [W, ...], losses [W])`` via torch.func."""
        from torch.func import functional_call, grad_and_value, vmap

        if any(True for _ in self.model.buffers()):
            names = [n for n, _ in self.model.named_buffers()][:3]
            raise ValueError(f"train.vmap_workers: model {self.cfg.model!r} has buffers ({', '.join(names)}, ...: "
                             f"BatchNorm statistics), which a vmapped gradient cannot update; set vmap_workers = false")
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]

        def loss_of(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(self.model, params, (x,)), y)

        batched = vmap(grad_and_value(loss_of), in_dims=(None, 0, 0))

        def run(x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
            params = {n: p.detach() for n, p in zip(names, self.params)}
            grads, losses = batched(params, x, y)
            return [grads[n] for n in names], losses

        return run

    def local_gradients(self, step: int) -> tuple[dict[int, torch.Tensor], list[float]]:
        """Every local worker's flat gradient and loss at ``step`` (one by one, or in one vmap call)."""
        workers = list(self.transport.local_workers)
        if self._vmapped is None:
            grads, losses = {}, []
            for w in workers:
                grads[w], loss = self.worker_gradient(w, step)
                losses.append(loss)
            return grads, losses
        idx = torch.stack([self.batches.indices(w, step) for w in workers])
        x = self.data.train.x[idx].to(self.device)
        y = self.data.train.y[idx].to(self.device)
        self.model.train()
        per_param, loss = self._vmapped(x, y)
        flat = torch.cat([g.reshape(len(workers), -1) for g in per_param], dim=1)
        if self.cfg.weight_decay:
            flat = flat + self.cfg.weight_decay * torch.cat([p.detach().reshape(-1) for p in self.params])
        return {w: flat[i] for i, w in enumerate(workers)}, [float(v) for v in loss]

    def apply_update(self, update: torch.Tensor, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = update[offset : offset + n].view_as(p).to(p.device, p.dtype)
            offset += n
        self.optimizer.step()

    def measures_coded(self, step: int) -> bool:
        """Whether ``step``'s uplink is also measured with the best coding (``train.coded_every``)."""
        return self.cfg.coded_every > 0 and step % self.cfg.coded_every == 0

    def gather_coded(self, local: dict[int, int]) -> list[int]:
        """Every worker's coded uplink size, in worker order, on every process (from each process's
        ``local``: its local workers' sizes, in the order of ``transport.local_workers``)."""
        rows = self.transport.all_gather_ints([local[w] for w in self.transport.local_workers])
        sizes = [v for row in rows for v in row]
        if len(sizes) != self.cfg.workers:
            raise RuntimeError(f"coded sizes of {len(sizes)} workers gathered, expected {self.cfg.workers}")
        return sizes

    # --- one step -------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Step ``next_step``: every local worker's gradient, its exchange and the optimizer step (Local
        SGD: one inner step, and at the end of a round the exchange of pseudo-gradients)."""
        if self.local is not None:
            res = self.local.step()
        else:
            n = self.next_step
            t0 = time.perf_counter()
            grads, losses = self.local_gradients(n)
            res = self.communicate(grads, n, n, self.lr_at(n), losses, time.perf_counter() - t0)
        self.next_step += 1
        return res

    def hand_worker_norms(self, vectors: dict[int, torch.Tensor], workers: int, index: int) -> None:
        """A policy that estimates the gradient noise from the workers' norms (the link policy) gets them
        before the step, where this process holds every worker's vector (the in-process simulation).
        The exchange of a topology that feeds them (sharded, allgather) gathers the ranks' norms itself, and its figures replace these
        (:mod:`dqsgd.topology.exchange`): the simulation then folds what a run over processes folds; at the
        exchanges ``index`` the policy takes statistics of only (:func:`~dqsgd.topology.figures.observes`)."""
        from dqsgd.topology.figures import observes

        policy = getattr(self.step_runner, "policy", None)
        wants = getattr(policy, "needs_worker_norms", False) and observes(policy, index)
        if wants and self.state.policy is not None and len(vectors) == workers >= 2:
            self.state = dataclasses.replace(
                self.state, policy=policy.observe_workers(self.state.policy, *worker_norms(vectors.values())))

    def communicate(self, vectors: dict[int, torch.Tensor], n: int, index: int, lr: float, losses: list[float],
                    compute_s: float, compute_steps: int = 1) -> StepResult:
        """Exchange ``vectors`` (one per local worker) as the ``index``-th exchange (its quantization
        keys and the policy's step), record its bytes in the ledger as step ``n``, and apply the
        decoded average with the optimizer at ``lr``; skipped when a vector is not finite.
        ``compute_steps``: the training steps each worker computed since the last exchange (a Local SGD
        round's length), which the simulated clock waits for."""
        bits, t = self.state.bits, self.transport
        t1 = time.perf_counter()
        if not all_finite(t, vectors, index, self.cfg.on_nonfinite):
            if not self.skipped:  # said once; the run summary counts them all (skipped_steps)
                warnings.warn(f"step {n}: a worker's gradient (its loss) is NaN or Inf: the step is skipped on every "
                              "rank (train.on_nonfinite = 'skip'); later skips are only counted", RuntimeWarning,
                              stacklevel=2)
            self.skipped += 1
            return StepResult(n, float("nan"), lr, bits, True, [], 0, 0, compute_s, 0.0, 0.0,
                              sim_time_s=self.timer.elapsed)
        self.hand_worker_norms(vectors, t.workers, index)
        self.timer.start(n, compute_steps)
        r = self.step_runner.run(self.timer.transport(t), vectors, self.state, index, self.qgen,  # type: ignore[arg-type]
                                 measure_coded=self.measures_coded(index))
        t2 = time.perf_counter()
        coded = None if r.coded is None else self.gather_coded(r.coded)
        coded_s = r.coded_s + time.perf_counter() - t2
        up, wire, dropped, _ = self.timer.account(r.uplink(), r.up, r.down, self.topology, r.wire() if r.up else ([], []))
        down = sum(r.down)
        if up:  # the aggregating process (a ps rank other than the server sees no uplink sizes)
            self.ledger.record(n, bits, up, down, r.side, *wire, coded_up=coded, dropped=dropped)
            for index, worker, size in getattr(t, "late", ()):  # stragglers' payloads read over processes
                self.ledger.record_late(index, worker, size)
        assert r.state is not None
        self.state = r.state
        self.apply_update(r.update.to(self.device), lr)
        t3 = time.perf_counter()
        return StepResult(n, t.mean_loss(losses), lr, bits, False, up, down, r.side, compute_s, r.encode_s,
                          t3 - t1 - r.encode_s - coded_s, coded, coded_s, self.timer.elapsed,
                          dropped if self.cfg.backup_workers else None)

    # --- state ----------------------------------------------------------------------------------
    def run_meta(self) -> dict[str, Any]:
        """What identifies this run and rank; a state dict of another run is refused."""
        meta = {"method": self.entry.label, "numel": self.numel, "steps": self.cfg.steps, "seed": self.seed,
                "workers": self.cfg.workers, "rank": self.transport.rank, "topology": self.topology,
                **self.downlink.fields(),
                **{f"method.{k}": v for k, v in dataclasses.asdict(self.entry.config).items()}}
        if self.local is None:
            return meta
        streaming = {"fragments": self.cfg.fragments, "overlap_steps": self.cfg.overlap_steps} if self.cfg.streaming else {}
        return {**meta, "local_steps": self.cfg.local_steps, **streaming}

    def state_dict(self) -> dict[str, Any]:
        """Everything that decides the rest of the run, as plain containers, numbers and tensors
        (``torch.load(weights_only=True)`` reads it back): model, optimizer, the bit policy's state
        (None on a rank that does not run it, which keeps ``bits``), the error-feedback memory, the
        ledger (the aggregating process's), the quantization generators and the step counters;
        ``down_residuals``: the error-fed downlink's residuals of the shards this process serves."""
        server = self.transport.is_server
        # Local SGD's state first: it waits for an exchange in flight, which draws from the generators
        local = {} if self.local is None else {"local": self.local.state_dict()}
        return {
            "format": STATE_FORMAT,
            "meta": self.run_meta(),
            "next_step": self.next_step,
            "skipped": self.skipped,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "policy": state_to_dict(self.state.policy) if server and self.state.policy is not None else None,
            "residuals": {int(w): r for w, r in enumerate(self.state.residuals) if r is not None},
            "down_residuals": {int(j): r for j, r in self.state.down_residuals.items()},
            "ledger": self.ledger.state_dict() if server else None,
            "qgen": {int(w): g.get_state() for w, g in self.qgen.items()},
            "bits": self.state.bits,
            "sim_time_s": self.timer.elapsed,
            **local,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue from ``sd`` (a :meth:`state_dict` of this run and rank)."""
        if sd.get("format") != STATE_FORMAT:
            raise ValueError(f"not a trainer state of format {STATE_FORMAT} (format {sd.get('format')!r})")
        check_state(sd, _STATE_KEYS, "trainer state")
        saved = sd["meta"]
        # Keys an older state lacks are not compared (its method config, downlink feedback and coding were not
        # recorded; its downlink was fixed, which a coded one equals in every decoded value).
        refuse_changed("the trainer state", saved, self.run_meta(),
                       lambda k: k in saved or not (k.startswith("method.") or k in BEFORE))
        # the error-fed downlink's residuals of the shards this process serves (absent: a run without them)
        fed = check_residuals(sd.get("down_residuals", {}), shard_lengths(self.step_runner), "the trainer state",
                              "down_residuals")
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        residuals: list[torch.Tensor | None] = [None] * self.cfg.workers
        for w, r in sd["residuals"].items():
            residuals[int(w)] = r
        if sd["policy"] is not None:
            self.state = MethodState(state_from_dict(type(self.policy.init()), sd["policy"]), residuals,
                                     down_residuals=fed)
        else:
            self.state = MethodState(None, residuals, int(sd["bits"]), fed)
        if sd["ledger"] is not None:
            self.ledger = Ledger.from_state_dict(sd["ledger"])
        for w, st in sd["qgen"].items():
            self.qgen[int(w)].set_state(st)
        if self.local is not None:
            self.local.load_state_dict(sd["local"])
        self.next_step = int(sd["next_step"])
        self.skipped = int(sd["skipped"])
        self.timer.elapsed = float(sd.get("sim_time_s", 0.0))  # states written before the simulated clock: 0
        self.transport.steps = self.next_step  # error messages count completed steps

    # --- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batch: int = 1000) -> tuple[float, float]:
        self.model.eval()
        x, y = self.data.test.x, self.data.test.y
        if self.cfg.eval_samples:
            x, y = x[: self.cfg.eval_samples], y[: self.cfg.eval_samples]
        correct, total_loss = 0, 0.0
        for i in range(0, len(y), batch):
            out = self.model(x[i : i + batch].to(self.device))
            yy = y[i : i + batch].to(self.device)
            total_loss += float(F.cross_entropy(out, yy, reduction="sum"))
            correct += int((out.argmax(dim=1) == yy).sum())
        return correct / max(len(y), 1), total_loss / max(len(y), 1)

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.params])


def record_of(r: StepResult, ledger: Ledger) -> dict[str, Any]:
    """One metrics.jsonl line. ``rank_*_bytes``: the busiest rank's link bytes this step (Ledger);
    ``coded_up_bytes`` (all workers' uplink with the best coding) and ``coded_s`` (the time measuring it
    took here): on the steps where it was measured (``train.coded_every``)."""
    last = ledger.records[-1] if ledger.records and ledger.records[-1].step == r.step and not r.skipped else None
    ranks = {} if last is None or not last.rank_up else {
        "rank_up_bytes": max(last.rank_up), "rank_down_bytes": max(last.rank_down),
        "rank_total_bytes": max(a + b for a, b in zip(last.rank_up, last.rank_down))}
    coded = {} if r.coded_up is None else {"coded_up_bytes": sum(r.coded_up), "coded_s": r.coded_s}
    backup = {} if r.dropped is None else {"dropped": list(r.dropped)}
    return {
        "step": r.step, "loss": r.loss, "lr": r.lr, "bits": r.bits, "skipped": r.skipped,
        "up_bytes": sum(r.up_bytes), "down_bytes": r.down_bytes * len(r.up_bytes), "side_bytes": r.side_bytes, **ranks,
        **coded, "budget_left": ledger.budget_left(), "compute_s": r.compute_s, "encode_s": r.encode_s,
        "decode_s": r.decode_s, "sim_time_s": r.sim_time_s, **backup,
    }
