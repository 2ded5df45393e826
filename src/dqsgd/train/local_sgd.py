"""Local SGD with compressed pseudo-gradients for your own training loop (torch.distributed).

:class:`LocalSGDOptimizer` wraps your optimizer and model, in the manner of PyTorch's
``PostLocalSGDOptimizer``: every process trains its own copy of the model with your optimizer; every
``local_steps`` = H calls of :meth:`~LocalSGDOptimizer.step`, the pseudo-gradient Δ = θ_start − θ of
each process is quantized by a dqsgd method, exchanged over the sharded collective (the transport and
step object of ``dqsgd train --transport torch``: :class:`dqsgd.topology.step.ExchangeStep`), and the decoded
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
At the first exchange of a process (and the first after :meth:`~LocalSGDOptimizer.load_state_dict`)
the ranks compare, with the project's one rank agreement (:func:`dqsgd.topology.agreement.agree`),
every setting of :meth:`~LocalSGDOptimizer.fields`, their progress (steps and rounds done) and a hash
of the parameters the round started from; every rank refuses a difference with
:class:`~dqsgd.transport.torch_dist.RankDisagreement` naming the fields and the ranks. Initial
parameters that differ are refused, not reconciled: build the model under the same seed on every
rank (or load the same state) — an exchange only averages Δ, so it would never make them equal.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from dqsgd.core.comm_stats import CompressionStats
from dqsgd.core.ranges import check_count, check_outer, check_seed, check_timeout
from dqsgd.core.rng import QUANT, generator
from dqsgd.method.config import MethodConfig, check_fed_policy, method_config
from dqsgd.method.pipeline import Method, MethodState
from dqsgd.policies import state_from_dict, state_to_dict
from dqsgd.topology.agreement import agree, check_residuals, check_state, refuse_changed, shard_lengths, tensor_digest
from dqsgd.topology.downspec import DownlinkSpec, downlink_of
from dqsgd.topology.names import AUTO, check_downlink_bits
from dqsgd.quantizers.sparse import SPARSE_SCHEMES
from dqsgd.topology.sparse import local_step_for
from dqsgd.topology.step import all_finite
from dqsgd.topology.registry import PROCESSES_DEFAULT, ring_bytes, topology_of
from dqsgd.train.fragments import Exchanger, Fragment, Pending, Streaming, build_fragments
from dqsgd.train.local import copy_into, outer_optimizer
from dqsgd.train.schedule import check_streaming
from dqsgd.transport.torch_dist import make_transport

__all__ = ["CompressionStats", "LocalSGDOptimizer"]

FORMAT = 2  # 2: the settings as named fields (format 1 held a list of hashes)
NO_HORIZON = ("fixed", "adaptive", "adaqs")  # bit policies that do not plan over the number of rounds
TRAFFIC = ("up_sent", "up_received", "down_sent", "down_received", "fp32_bytes", "dense_bytes", "bit_coords", "coords")


class LocalSGDOptimizer:
    """``optimizer`` (over ``model``'s parameters) with a compressed Local SGD exchange every
    ``local_steps`` steps; see the module docstring.

    ``method``: a dqsgd method name or config (``method_options`` are passed to
    :func:`dqsgd.method.config.method_config`); ``rounds``: how many exchanges the run will have (needed by
    the bit policies that plan over the run: DQSGD's rules and budgets); ``outer``: "sgd" | "nesterov"
    with ``outer_lr`` and ``outer_momentum``; ``topology``: "sharded" (default), "allgather" or "ps";
    ``downlink_bits``: the sharded downlink's width (32 = fp32); ``downlink_coding``: its coding
    (None: the method's uplink coding, :mod:`dqsgd.topology.downlink`); ``downlink_feedback``: the error-fed
    downlink (sharded, 2..16 bits: each shard server rounds its average plus its residual to the nearest level
    and keeps the new residual, saved in :meth:`state_dict`); ``seed``: the quantization streams'
    seed; ``group``/``timeout``: the process group and the per-collective timeout in seconds;
    ``fragments`` = F and ``overlap`` = τ: streaming rounds (:mod:`dqsgd.train.fragments`) — the parameters
    in F fragments of whole tensors, fragment f exchanged every ``local_steps`` steps at offset ⌊f·H/F⌋, its
    exchange running (on a second process group, one background thread) while the next τ < H steps compute
    and its result merged with the progress made since; with ``rounds`` the last exchanges complete at step
    ``rounds``·H, else at :meth:`finish`. ``error_feedback=True`` (a method option): each round's quantization
    residual is added to the next round's Δ (per fragment); sparse methods ``topk``, ``randk``, ``topk-budget``
    (options ``topk_ratio``, ``bits``, ``target_bits``/``budget_bits``): indices and quantized values of k
    coordinates (:mod:`dqsgd.topology.sparse`); the residual and the budget's state are in :meth:`state_dict`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, local_steps: int,
                 method: str | MethodConfig = "qsgd-4bit", *, rounds: int | None = None, outer: str = "sgd",
                 outer_lr: float = 1.0, outer_momentum: float = 0.0, topology: str = PROCESSES_DEFAULT,
                 downlink_bits: int = 8, seed: int = 0, group: Any = None, timeout: float | None = None,
                 downlink_coding: str | None = None, downlink_feedback: bool = False, fragments: int = 1,
                 overlap: int = 0, **method_options: Any):
        check_count("local_steps", local_steps, 1)
        check_streaming(fragments, overlap, local_steps)
        check_outer(outer, outer_lr, outer_momentum)
        check_seed("seed", seed)
        check_timeout("timeout", timeout)
        if rounds is not None:
            check_count("rounds", rounds, 1)
        config = method if isinstance(method, MethodConfig) else method_config(method, **method_options)
        check_fed_policy(config, "LocalSGDOptimizer")
        if rounds is None and config.policy not in NO_HORIZON:
            raise ValueError(f"method {config.name!r} (policy {config.policy!r}) plans over the run: pass rounds=, "
                             f"the number of exchanges (steps // local_steps)")
        self.optimizer, self.local_steps = optimizer, local_steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        sizes = [p.numel() for p in self.params]
        self.method = Method(config, sum(sizes), rounds or 1, sizes)
        self.transport = make_transport(topology, group, timeout=timeout)
        self.rank, self.workers = self.transport.rank, self.transport.workers
        if downlink_bits != AUTO:  # a width is given (no method default; no safety refusal: it has no such keyword)
            check_downlink_bits(downlink_bits)
        downlink = downlink_of({"downlink_bits": downlink_bits, "downlink_coding": downlink_coding,
                                "downlink_feedback": downlink_feedback, "allow_unsafe_downlink": True}, config, topology)
        self.step_runner = local_step_for(self.method, topology, sizes, self.workers, seed, downlink)
        self.outer = outer_optimizer(self.params, outer, outer_lr, outer_momentum)
        self.state = self.method.init_state(self.workers, self.step_runner.policy)
        self.qgen = {self.rank: generator(seed, QUANT, self.rank)}
        self._fields = {**{f"method.{k}": v for k, v in dataclasses.asdict(config).items()},
                        "local_steps": local_steps, "numel": sum(sizes), "topology": topology,
                        "downlink_bits": downlink_bits, "downlink_coding": downlink_coding, "outer": outer,
                        "outer_lr": float(outer_lr), "outer_momentum": float(outer_momentum), "seed": seed,
                        "rounds": rounds, **({"fragments": fragments, "overlap": overlap}
                                             if fragments != 1 or overlap else {}),
                        **({"downlink_feedback": True} if downlink_feedback else {})}
        self.start = self._flat()
        self.steps, self.rounds_done, self.checked = 0, 0, False
        self.link_bytes = 0  # bytes this rank sent and received in the exchanges (uplink and downlink phases)
        self.topology, self.downlink_bits = topology, downlink_bits
        self.traffic = dict.fromkeys(TRAFFIC, 0)  # compression_stats()'s counters, this rank's
        self.downlink = downlink
        self.stream = None if fragments == 1 and not overlap else _Stream(
            self, config, sizes, fragments, overlap, rounds, seed, downlink)

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
        if self.stream is not None:
            self.stream.step()
        elif self.steps % self.local_steps == 0:
            self.sync()
        return loss

    def finish(self) -> None:
        """Streaming (``fragments`` > 1 or ``overlap`` > 0): complete the exchanges in flight and exchange every
        fragment that progressed since its last one, so that every rank holds the same model with every step
        in it. Done by itself at step ``rounds``·``local_steps``; call it to stop elsewhere. Unfragmented:
        nothing to do (the model is the synchronized one after every H-th step)."""
        if self.stream is not None and self.steps:
            self.stream.step(last=True)

    # --- the exchange ---------------------------------------------------------------------------
    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params]).clone()

    def fields(self) -> dict[str, Any]:
        """Every setting that changes what is sent or computed, by name: the method and every option,
        H, the model size, the exchange (topology, downlink), the outer optimizer, the seed, the rounds."""
        return dict(self._fields)

    def check_agreement(self) -> None:
        """Compare :meth:`fields`, the progress (steps, rounds done) and a hash of θ_start across the
        ranks; every rank raises at once, naming exactly the fields that differ, if any does."""
        from dqsgd import __version__

        mine = {**self.fields(), "progress.steps": self.steps, "progress.rounds_done": self.rounds_done,
                "params.start": tensor_digest(self.start), "dqsgd_version": __version__}
        agree(mine, self.transport.all_gather_ints, self.rank, what="this exchange")
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
        before, self.state = self.state, ex.state
        self._count(ex, delta[self.rank].numel(), before.bits)
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

    def _count(self, ex: Any, numel: int, bits: int, method: Method | None = None) -> None:
        """One exchange into :meth:`compression_stats`'s counters (a ps worker sees no sizes: nothing counted)."""
        up, down = ex.wire() if ex.up else ([0] * self.workers, [0] * self.workers)
        self.link_bytes += up[self.rank] + down[self.rank]
        if not ex.up:
            return
        legs = topology_of(ex.topology).legs(ex.up, ex.down, self.rank)
        for key, n in zip(TRAFFIC, legs):
            self.traffic[key] += n
        method = method or self.method
        itemsize = self.params[0].element_size()
        self.traffic["fp32_bytes"] += 4 * numel
        self.traffic["dense_bytes"] += 2 * ring_bytes(numel * itemsize, self.workers)
        # a sparse method's width is its values' (k of the d coordinates): count the bits it sent per coordinate
        sparse = method.config.scheme in SPARSE_SCHEMES
        self.traffic["bit_coords"] += 8 * sum(ex.up[self.rank]) if sparse else method.width(bits) * numel
        self.traffic["coords"] += numel

    def compression_stats(self) -> CompressionStats:
        """This rank's traffic since the optimizer was made (docs/api.md, "Statistics"): a round is an exchange
        of the pseudo-gradient, one every ``local_steps`` steps; the dense reference, a ring all-reduce of
        Δ in the parameters' dtype."""
        t = self.traffic
        return CompressionStats(t["up_sent"], t["up_received"], t["down_sent"], t["down_received"], t["fp32_bytes"],
                                t["dense_bytes"], t["bit_coords"] / t["coords"] if t["coords"] else math.nan,
                                steps=self.steps, rounds=self.rounds_done)

    def __repr__(self) -> str:
        down = "fp32" if self.downlink_bits == 32 else self.downlink_bits
        return (f"<LocalSGDOptimizer method={self.method.config.name!r} ({self.method.config.budget_text()}), "
                f"topology={self.topology}, downlink={down if topology_of(self.topology).downlink else 'none'}, "
                f"local_steps={self.local_steps}, workers={self.workers}, steps={self.steps}, "
                f"rounds={self.rounds_done}>")

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything to continue exactly, the model's current parameters included."""
        # first: the streaming state waits for the exchanges in flight, which draw from the quantization generator
        streaming = {} if self.stream is None else {"streaming": self.stream.streaming_state()}
        policy = self.state.policy
        return {
            "format": FORMAT, "fields": self.fields(), "rank": self.rank,
            "optimizer": self.optimizer.state_dict(), "outer": self.outer.state_dict(),
            "params": self._flat().cpu(), "start": self.start.cpu(),
            "steps": self.steps, "rounds_done": self.rounds_done,
            "policy": None if policy is None else state_to_dict(policy), "bits": self.state.bits,
            "residual": self.state.residuals[self.rank], "qgen": self.qgen[self.rank].get_state(),
            "down_residuals": {int(j): r.cpu() for j, r in self.state.down_residuals.items()},
            "link_bytes": self.link_bytes, "traffic": dict(self.traffic), **streaming,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (of this rank, under the same :meth:`fields`). Everything is
        checked before anything is loaded; the ranks agree again at the next exchange."""
        what = "LocalSGDOptimizer state"
        if not isinstance(sd, dict) or sd.get("format") != FORMAT:
            got = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"not a LocalSGDOptimizer state of format {FORMAT} (format {got!r})")
        check_state(sd, _STATE_KEYS, what)
        refuse_changed(what, sd["fields"], self.fields())
        if sd["rank"] != self.rank:
            raise ValueError(f"{what} is rank {sd['rank']}'s; this is rank {self.rank} (each rank loads its own)")
        n = self.start.numel()
        for key in ("params", "start", "residual"):
            t = sd[key]
            if t is not None and tuple(t.shape) != (n,):
                raise ValueError(f"{what}: malformed state, {key!r} has shape {tuple(t.shape)}, the model {n} elements")
        traffic = check_state(sd.get("traffic", {}), {}, f"{what} traffic")  # older states: counted from here
        bad = sorted(str(k) for k, v in traffic.items()
                     if k not in TRAFFIC or not isinstance(v, int) or isinstance(v, bool) or v < 0)
        if bad:
            raise ValueError(f"{what}: malformed state, traffic counter(s) {bad} (known: {', '.join(TRAFFIC)})")
        # the error-fed downlink's shard residuals (absent: saved without them)
        fed = check_residuals(sd.get("down_residuals", {}), shard_lengths(self.step_runner), what, "down_residuals")
        policy = None if sd["policy"] is None else state_from_dict(type(self.step_runner.policy.init()), sd["policy"])
        if (self.stream is None) != ("streaming" not in sd):
            raise ValueError(f"{what}: malformed state, 'streaming' {'absent' if self.stream else 'present'}")
        if self.stream is not None:
            self.stream.check_streaming_state(sd["streaming"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.outer.load_state_dict(sd["outer"])
        copy_into(self.params, sd["params"].to(self.params[0].device))
        self.start = sd["start"].to(self.params[0].device).clone()
        self.steps, self.rounds_done, self.checked = sd["steps"], sd["rounds_done"], False
        residuals = [None] * self.workers
        residuals[self.rank] = sd["residual"]
        self.state = MethodState(policy, residuals, -1 if policy is not None else int(sd["bits"]), fed)
        self.qgen[self.rank].set_state(sd["qgen"])
        self.link_bytes = int(sd["link_bytes"])
        self.traffic = {**dict.fromkeys(TRAFFIC, 0), **traffic}
        if self.stream is not None:
            self.stream.start = self.start
            self.stream.load_streaming_state(sd["streaming"])


_STATE_KEYS = {"fields": dict, "rank": int, "optimizer": dict, "outer": dict, "params": torch.Tensor,
               "start": torch.Tensor, "steps": int, "rounds_done": int, "policy": (dict, None), "bits": int,
               "residual": (torch.Tensor, None), "qgen": torch.Tensor, "link_bytes": int}


class _Stream(Streaming):
    """:class:`LocalSGDOptimizer`'s streaming rounds (:mod:`dqsgd.train.fragments`): this process's one worker
    is the model itself; its fragments are exchanged on the schedule, each applied ``overlap`` steps later."""

    def __init__(self, opt: LocalSGDOptimizer, config: MethodConfig, sizes: list[int], fragments: int, overlap: int,
                 rounds: int | None, seed: int, downlink: DownlinkSpec):
        check_streaming(fragments, overlap, opt.local_steps, len(sizes))
        h = opt.local_steps
        self.opt, self.local_steps, self.overlap = opt, h, overlap
        self.steps = None if rounds is None else rounds * h  # the run's last step, if known
        self.frags: list[Fragment] = build_fragments(config, sizes, fragments, h, (rounds or 1) * h, opt.topology,
                                                     opt.workers, seed, downlink)
        self.start, self.serial, self.pending = opt.start, 0, []
        self.exchanger = Exchanger(opt.transport, overlap)

    def step(self, last: bool = False) -> None:
        o = self.opt
        with o.transport.guard():
            if not o.checked:
                o.check_agreement()
            self.advance(o.steps, last or o.steps == self.steps)

    def locals_of(self, frag: Fragment) -> dict[int, torch.Tensor]:
        return {self.opt.rank: torch.cat([p.detach().reshape(-1) for p in self.opt.params[frag.lo: frag.hi]]).clone()}

    def set_local(self, frag: Fragment, worker: int, value: torch.Tensor) -> None:
        copy_into(self.opt.params[frag.lo: frag.hi], value)

    def job(self, frag: Fragment, vectors: dict[int, torch.Tensor], index: int, serial: int) -> Callable[[Any], Any]:
        qgen, state, delta = self.opt.qgen, frag.state, {w: v.cpu() for w, v in vectors.items()}

        def run(t: Any) -> Any:
            all_finite(t, delta, index, "raise")
            return frag.runner.run(t, delta, state, index, qgen)
        return run

    def finish(self, p: Pending, out: Any) -> None:
        o, fr = self.opt, p.frag
        o._count(out, fr.b - fr.a, fr.state.bits, fr.method)
        fr.state = out.state
        self.apply(p, out.update, o.outer, o.params)
        o.rounds_done += 1
