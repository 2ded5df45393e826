"""The training loop: data → gradient per worker → method → update (DQSGD Algorithm 2).

One step, written once for every transport:

1. every local worker w draws its minibatch (a pure function of seed, w, n) and computes g_w;
2. (TernGrad) the per-tensor scalers are max-reduced across workers;
3. each worker encodes g_w at the current width B_n into bytes;
4. the server gathers the W payloads, decodes and averages them into G, encodes the downlink,
   records the measured bytes in the ledger and lets the policy pick B_{n+1} from ‖G‖;
5. every process decodes the downlink and applies the same optimizer step.

Topology ``sharded`` replaces 3–5 with :class:`dqsgd.step.ShardedStep` (every rank the server of
one shard, both ways quantized); the trainer records its bytes and runs the policy on every rank.

On the steps n with n % ``train.coded_every`` == 0, every process also measures the uplink it sends
with the best coding (:meth:`dqsgd.pipeline.Method.coded_size` of each local worker's payload, or
the sum over its W shard payloads), and the sizes are all-gathered (``Transport.all_gather_ints``)
so that every ledger records the same W numbers. Nothing sent changes: the model and the widths
are the same with or without the measurement.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dqsgd.data import Dataset
from dqsgd.kernels import HashRNG
from dqsgd.ledger import Ledger, wire_traffic
from dqsgd.models import build_model
from dqsgd.pipeline import Method, MethodState
from dqsgd.quantizers import NonFiniteGradientError
from dqsgd.step import ShardedStep
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.sampling import MODEL_INIT, QUANT, WorkerBatches, generator, seed_for
from dqsgd.transport import SimTransport, Transport


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    bits: int
    skipped: bool
    up_bytes: list[int]
    down_bytes: int
    side_bytes: int
    compute_s: float
    encode_s: float
    decode_s: float
    coded_up: list[int] | None = None  # per worker, the uplink with the best coding (measured steps only)
    coded_s: float = 0.0               # seconds this process spent measuring it (not in encode_s/decode_s)


class Trainer:
    """One method, one seed, one (local part of a) run."""

    def __init__(self, cfg: TrainConfig, entry: MethodEntry, data: Dataset, seed: int,
                 transport: Transport | None = None, device: torch.device | str = "cpu"):
        self.cfg, self.entry, self.data, self.seed = cfg, entry, data, seed
        self.transport = transport or SimTransport(cfg.workers, cfg.topology or "ps")
        if self.transport.workers != cfg.workers:
            raise ValueError(f"transport has {self.transport.workers} workers, config says {cfg.workers}")
        self.topology = str(getattr(self.transport, "topology", "ps"))
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
        momentum = entry.momentum if entry.momentum is not None else cfg.momentum
        self.optimizer = torch.optim.SGD(self.params, lr=self.lr, momentum=momentum)
        self.method = Method(entry.config, self.numel, cfg.steps, sizes)
        self.state: MethodState = self.method.init_state(cfg.workers)
        self.batches = WorkerBatches(len(data.train.y), cfg.workers, cfg.batch_size, seed)
        self.qgen = {w: generator(seed, QUANT, w) for w in self.transport.local_workers}
        # kernel "fused": uniforms are a pure function of (seed, step, worker) — no state to checkpoint.
        self.quant_seed = seed_for(seed, QUANT)
        self.ledger = Ledger(self.numel, cfg.workers, self.method.budget_bits(), topology=self.topology)
        self.sharded = (ShardedStep(self.method, sizes, cfg.workers, seed, cfg.downlink_bits)
                        if self.topology == "sharded" else None)
        self._vmapped = self._vmap_gradients() if cfg.vmap_workers else None
        self.next_step = 0
        self.skipped = 0

    # --- pieces of a step -----------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        if self.cfg.lr_schedule == "cosine":
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * step / self.cfg.steps))
        return self.lr

    def worker_gradient(self, worker: int, step: int) -> tuple[torch.Tensor, float]:
        idx = self.batches.indices(worker, step)
        x = self.data.train.x[idx].to(self.device)
        y = self.data.train.y[idx].to(self.device)
        self.model.train()
        loss = F.cross_entropy(self.model(x), y)
        grads = torch.autograd.grad(loss, self.params)
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.cfg.weight_decay:
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

    def _all_finite(self, grads: dict[int, torch.Tensor]) -> bool:
        bad = torch.tensor([0.0 if bool(torch.isfinite(g).all()) else 1.0 for g in grads.values()])
        return float(self.transport.max_reduce([bad.amax().reshape(1)])[0]) == 0.0

    # --- one step -------------------------------------------------------------------------------
    def step(self) -> StepResult:
        n, bits, t = self.next_step, self.state.bits, self.transport
        t0 = time.perf_counter()
        grads, losses = self.local_gradients(n)
        t1 = time.perf_counter()
        shared = len(t.local_workers) < t.workers  # several processes: all must take the same branch
        if (self.cfg.on_nonfinite == "skip" or shared) and not self._all_finite(grads):
            if self.cfg.on_nonfinite == "raise":
                raise NonFiniteGradientError(f"step {n}: a worker's gradient has NaN or Inf on some rank "
                                             f"(on_nonfinite = 'raise': every rank stops)")
            self.skipped += 1
            self.next_step += 1
            return StepResult(n, float("nan"), self.lr_at(n), bits, True, [], 0, 0, t1 - t0, 0.0, 0.0)
        if self.sharded is not None:
            return self._sharded_step(n, bits, grads, losses, t1 - t0)
        scalers, side = None, 0
        if self.method.shares_scalers:
            scalers = t.max_reduce([self.method.local_scalers(g) for g in grads.values()])
            side = 4 * scalers.numel()  # L float32 scalers up and down per worker [docs/algorithms.md §3]
        payloads = []
        for w, g in grads.items():
            g = codec_input(g, self.method)
            try:
                key = HashRNG(self.quant_seed, n, w) if self.method.fused else None
                msg, self.state.residuals[w] = self.method.encode(g, bits, self.qgen[w], self.state.residuals[w], scalers,
                                                                  hash_rng=key)
            except NonFiniteGradientError as e:
                raise NonFiniteGradientError(f"step {n}, worker {w}: {e}") from None
            payloads.append(msg)
        t2 = time.perf_counter()
        gathered = t.gather(payloads, self.method.max_payload_bytes(bits))
        down, next_bits, up = None, None, []
        if t.is_server and gathered is not None:
            agg = self.method.aggregate(gathered, bits)
            down = self.method.encode_downlink(agg)
            up = [len(p) for p in gathered]
            sent_down = 0 if self.topology == "allgather" else len(down)  # all-gather: no downlink crosses a link
            self.ledger.record(n, bits, up, sent_down, side, *wire_traffic(self.topology, [[b] for b in up], [sent_down]))
            self.state = self.method.observe(self.state, agg, n, 8 * max(up))
            next_bits = self.state.bits
        down, next_bits = t.broadcast(down, next_bits)
        if not t.is_server:
            self.state.policy = _RemoteBits(next_bits)
        update = self.method.decode_downlink(down)
        lr = self.lr_at(n)
        self.apply_update(update.to(self.device), lr)
        t3 = time.perf_counter()
        # Measured after the downlink: the server has accepted every payload (a malformed one stopped the step).
        coded = None
        if self.measures_coded(n):
            coded = self.gather_coded({w: self.method.coded_size(p) for w, p in zip(grads, payloads)})
            if t.is_server:
                self.ledger.record_coded(n, coded)
        coded_s = time.perf_counter() - t3
        self.next_step += 1
        loss = t.mean_loss(losses)
        down_bytes = 0 if self.topology == "allgather" else len(down)
        return StepResult(n, loss, lr, bits, False, up, down_bytes, side, t1 - t0, t2 - t1, t3 - t2, coded, coded_s)

    def _sharded_step(self, n: int, bits: int, grads: dict[int, torch.Tensor], losses: list[float],
                      compute_s: float) -> StepResult:
        """Every rank: the sharded exchange, then the same ledger entry, policy step and update."""
        assert self.sharded is not None
        t2 = time.perf_counter()
        r = self.sharded.run(self.transport, grads, bits, n, self.qgen, self.state.residuals,  # type: ignore[arg-type]
                             measure_coded=self.measures_coded(n))
        for w, res in r.residuals.items():
            self.state.residuals[w] = res
        t_coded = time.perf_counter()
        coded = None if r.coded is None else self.gather_coded(r.coded)
        coded_s = r.coded_s + time.perf_counter() - t_coded
        up, down = [sum(row) for row in r.up], sum(r.down)
        self.ledger.record(n, bits, up, down, r.side, *r.wire(), coded_up=coded)
        self.state = self.method.observe(self.state, r.update, n, 8 * max(up))
        lr = self.lr_at(n)
        self.apply_update(r.update.to(self.device), lr)
        t3 = time.perf_counter()
        self.next_step += 1
        return StepResult(n, self.transport.mean_loss(losses), lr, bits, False, up, down, r.side, compute_s,
                          r.encode_s, t3 - t2 - r.encode_s - coded_s, coded, coded_s)

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


def codec_input(g: torch.Tensor, method: Method) -> torch.Tensor:
    """The gradient where ``method``'s encoder takes it. The fused kernel (no error feedback) takes
    it on any device: its payload depends only on the values, and it moves to the host itself only
    what host code needs. The torch-kernel quantizers draw from CPU generators and error-feedback
    residuals live on the CPU, so those get a CPU copy."""
    if g.device.type == "cpu" or (method.fused and not method.config.error_feedback):
        return g
    return g.cpu()


@dataclass
class _RemoteBits:
    """A non-server rank only learns B_{n+1} from the broadcast; it holds no policy state."""

    bits: int


def record_of(r: StepResult, ledger: Ledger) -> dict[str, Any]:
    """One metrics.jsonl line. ``rank_*_bytes``: the busiest rank's link bytes this step (Ledger);
    ``coded_up_bytes`` (all workers' uplink with the best coding) and ``coded_s`` (the time measuring it
    took here): on the steps where it was measured (``train.coded_every``)."""
    last = ledger.records[-1] if ledger.records and ledger.records[-1].step == r.step and not r.skipped else None
    ranks = {} if last is None or not last.rank_up else {
        "rank_up_bytes": max(last.rank_up), "rank_down_bytes": max(last.rank_down),
        "rank_total_bytes": max(a + b for a, b in zip(last.rank_up, last.rank_down))}
    coded = {} if r.coded_up is None else {"coded_up_bytes": sum(r.coded_up), "coded_s": r.coded_s}
    return {
        "step": r.step, "loss": r.loss, "lr": r.lr, "bits": r.bits, "skipped": r.skipped,
        "up_bytes": sum(r.up_bytes), "down_bytes": r.down_bytes * len(r.up_bytes), "side_bytes": r.side_bytes, **ranks,
        **coded, "budget_left": ledger.budget_left(), "compute_s": r.compute_s, "encode_s": r.encode_s,
        "decode_s": r.decode_s,
    }
