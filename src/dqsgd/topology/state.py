"""One bucket's state between its exchanges: the policy, the step, the per-rank memory.

:class:`Memory` is what one rank keeps of a bucket (its error-feedback residuals, its rounding
generator, its shard server's downlink residual); :class:`BucketState` is the bucket's state in one
process — its protocol, its policy's state, its step counter and the statistics not yet fed to the
policy — and is the memory of the process's own rank where it runs one (the DDP hook). The trainer's
simulation runs W ranks in one process: one :class:`BucketState` and W :class:`Memory`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dqsgd.topology.agreement import check_residuals

if TYPE_CHECKING:
    from dqsgd.method.pipeline import Method
    from dqsgd.topology.bucket import BucketProtocol

__all__ = ["BucketState", "Memory"]


@dataclass(kw_only=True)
class Memory:
    """What one rank keeps of a bucket between steps."""

    generator: torch.Generator | None = None       # TernGrad's rounding (the other schemes draw hash uniforms)
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # error feedback, per shard
    staged: dict[int, torch.Tensor] | None = None  # this step's new residuals, kept once no rank overflowed
    down_residual: torch.Tensor | None = None      # error-fed downlink: this rank's shard server residual e_j
    down_staged: torch.Tensor | None = None        # this step's new e_j, kept once no rank overflowed
    workspace: dict = field(default_factory=dict, repr=False, compare=False)  # the device codec's scratch buffers

    def commit(self, bad: torch.Tensor) -> None:
        """Keep this step's staged memory unless some rank's bucket was non-finite (``bad``)."""
        if self.staged is not None:
            if not bool(bad):
                self.residuals.update(self.staged)
            self.staged = None
        if self.down_staged is not None:  # selected on the device: no host sync
            old = self.down_residual if self.down_residual is not None else torch.zeros_like(self.down_staged)
            self.down_residual, self.down_staged = torch.where(bad.to(old.device), old, self.down_staged), None


@dataclass(kw_only=True)
class BucketState(Memory):
    """One bucket index in this process: its protocol (methods, shards, keys), policy state and step
    counter; and, as a :class:`Memory`, this process's rank's memory of it."""

    numel: int
    proto: BucketProtocol                # the bucket's per-step protocol (dqsgd.topology.bucket)
    policy: Any                          # the policy's state; .bits = this step's width
    sizes: tuple[int, ...] = ()          # the bucket's parameter sizes, in DDP's order
    step: int = 0                        # compressed steps of this bucket (the HashRNG step)
    pending: list[tuple] = field(default_factory=list)  # (step, [norm, rms, bad], spent_bits, G, event): unobserved
    bad: torch.Tensor | None = None      # device path: payloads that failed validation (read a step late)
    _bad_event: Any = field(default=None, repr=False)  # CUDA: recorded after ``bad`` was last written
    _size_cache: tuple[list, dict] | None = field(default=None, repr=False)  # (shards, {key: sizes})

    @property
    def method(self) -> Method:
        """The whole bucket's method: its policy picks every shard's width."""
        return self.proto.method

    @property
    def shards(self) -> list[Method]:
        """One method per shard (topology allgather: the bucket itself)."""
        return self.proto.shards

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return self.proto.bounds

    def uplink_bytes(self, width: int) -> int:
        """Bytes of every shard's fixed-coded uplink message at ``width``, summed."""
        return self._cached(("up", width), lambda: sum(m.message_bits(width) for m in self.shards) // 8)

    def _cached(self, key: tuple[str, int], compute: Any) -> Any:
        """``compute()`` once per key while the shards stay the same (sizes depend on them and the width
        alone; a reordered bucket gets new shards, and so a new cache)."""
        if self._size_cache is None or self._size_cache[0] is not self.shards:
            self._size_cache = (self.shards, {})
        cache = self._size_cache[1]
        if key not in cache:
            cache[key] = compute()
        return cache[key]

    @property
    def bits(self) -> int:
        return int(self.policy.bits)

    def width(self) -> int:
        return self.method.width(self.bits)

    def record(self, avg: torch.Tensor, step: int, spent_bits: int, bad: torch.Tensor,
               norms: torch.Tensor | None = None, sample: torch.Tensor | None = None) -> None:
        """Keep the statistics of step ``step``'s averaged bucket; ``bad``: some rank's bucket was
        non-finite (the policy then skips the step). A policy that reads G keeps only what it reads
        (the coded budget: its entropy sample, ≤ 65,536 coordinates, not a copy of the bucket). On a
        device they are reduced there and copied to pinned host memory without blocking; an event
        marks when they have arrived. ``norms``, ``sample``: G's ``[‖G‖_p, ‖G‖₂]`` and the policy's sample
        of G where ``avg`` is one shard of it (FSDP's reduce-scatter), else read off ``avg``."""
        from dqsgd.policies.base import grad_norms
        from dqsgd.policies.coded import read_stride

        m = self.method
        vals = torch.cat([grad_norms(avg, m.p) if norms is None else norms, bad.to(torch.float32).reshape(1)])
        policy = self.proto.policy
        keep = (avg[:: read_stride(policy, avg.numel())] if sample is None else sample) if policy.needs_grad else None
        if avg.device.type != "cuda":  # CPU (other devices: a blocking copy)
            self.pending.append((step, vals.cpu(), spent_bits, None if keep is None else keep.cpu().clone(), None))
            return
        host = torch.empty(3, dtype=torch.float32, pin_memory=True).copy_(vals, non_blocking=True)
        if keep is not None:
            keep = torch.empty(keep.shape, dtype=keep.dtype, pin_memory=True).copy_(keep, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((step, host, spent_bits, keep, event))

    def _take(self) -> tuple[int, list[float], int, torch.Tensor | None]:
        step, vals, spent, g, event = self.pending.pop(0)
        if event is not None:
            event.synchronize()  # a step already done: no wait for the work queued since
        return step, vals.tolist(), spent, g

    def payload_flag(self, out: torch.Tensor) -> torch.Tensor | None:
        """The bucket's deferred-validation flag on ``out``'s device (None: the host codec, which raises)."""
        from dqsgd.topology.payloads import device_path

        if not device_path(out):
            return None
        if self.bad is None or self.bad.device != out.device:
            self.bad = torch.zeros((), dtype=torch.bool, device=out.device)
        return self.bad

    def check_payloads(self, index: int) -> None:
        """Raise if a payload this rank decoded on the device path failed validation. The flag is
        read only once the work that set it has finished (CUDA: ``query`` of an event recorded after
        it), so the check never waits for the device; on CPU it is read at once."""
        from dqsgd.codecs import PayloadError

        if self.bad is None:
            return
        if self.bad.device.type == "cuda":
            if self._bad_event is None:
                self._bad_event = torch.cuda.Event()
                self._bad_event.record()
                return
            if not self._bad_event.query():
                return
            self._bad_event = None
        if bool(self.bad):
            raise PayloadError(f"bucket {index}: a payload this rank received at step {self.step - 1} or earlier "
                               "failed validation (crc, padding or code range): refusing to continue")

    def catch_up(self, last_step: int) -> None:
        """Feed the policy every recorded step ≤ ``last_step``."""
        from dqsgd.policies.base import stats_of

        while self.pending and self.pending[0][0] <= last_step:
            step, (norm, l2, bad), spent, g = self._take()
            if bad:  # an overflow step (GradScaler skips it): no statistics to learn from
                continue
            stats = stats_of(step, norm, l2, self.numel, spent, g)
            self.policy = self.proto.policy.update(self.policy, stats)

    def lag(self, device: torch.device) -> int:
        """Steps the policy's statistics wait before they are fed: 0 on the CPU; on CUDA 1, so that
        reading them never waits for the device (the width of step n+1 comes from step n−1)."""
        return 0 if device.type == "cpu" else 1

    def prepare(self, device: torch.device) -> None:
        """Before a step: raise if a payload decoded earlier failed its deferred checks, and feed the
        policy what waited (:meth:`lag`) so that this step's width is known."""
        self.check_payloads(self.proto.bucket)
        self.catch_up(self.step - 1 - self.lag(device))
        if getattr(self.policy, "coding", None) is not None:  # the link policy: the coding it priced
            self.proto.use_coding(self.policy.coding)

    def observe(self, update: torch.Tensor, step: int, spent: Any, bad: torch.Tensor,
                norms: torch.Tensor | None = None, sample: torch.Tensor | None = None,
                workers: tuple[float, float, int] | None = None) -> None:
        """The one point where the exchange feeds the policy: step ``step``'s update G (the same bytes
        on every rank), what the step cost, and whether some rank's bucket was non-finite (the policy
        then skips it). Recorded here, learnt from when the next width is needed (:meth:`catch_up`:
        the trainer at once, the hook when the bucket next arrives, :meth:`prepare`). ``workers``: the
        ranks' (Σ‖g_r‖², Σ rounding errors, W) where the exchange gathered them for a policy that
        estimates the gradient noise (:meth:`hand_workers`)."""
        from dqsgd.topology.figures import observes

        if self.method.config.dynamic and observes(self.proto.policy, step):  # the link policy: its steps alone
            self.record(update, step, spent, bad, norms, sample)
        if workers is not None:
            self.hand_workers(update, bad, *workers)

    def hand_workers(self, update: torch.Tensor, bad: torch.Tensor, sum_sq: float, errors: float, workers: int) -> None:
        """Hand the link policy the workers' norms of the step whose update is ``update`` (the same bytes
        on every rank: ‖G‖² in float64), unless some rank was non-finite; it folds them into σ̂² when it
        next learns (:mod:`dqsgd.policies.variance`). Reads ``update`` on the host (on a device: waits for it)."""
        if bool(bad) or not all(map(math.isfinite, (sum_sq, errors))):
            return
        g = update.detach().reshape(-1).to(torch.float64)
        mean_sq = float(g.dot(g))
        if math.isfinite(mean_sq):
            self.policy = self.proto.policy.observe_workers(self.policy, sum_sq, mean_sq, workers, errors)

    def state_dict(self) -> dict[str, Any]:
        from dqsgd.policies import state_to_dict

        pending = [self._take() for _ in range(len(self.pending))]
        self.pending = [(s, torch.tensor(v, dtype=torch.float32), b, g, None) for s, v, b, g in pending]
        return {"numel": self.numel, "sizes": self.sizes, "step": self.step, "policy": state_to_dict(self.policy),
                "residuals": {j: r.cpu().clone() for j, r in self.residuals.items()},
                "down_residual": None if self.down_residual is None else self.down_residual.cpu().clone(),
                "generator": self.generator.get_state(),
                "pending": [(s, v, b, None if g is None else g.clone()) for s, v, b, g in pending]}

    def load(self, d: dict[str, Any], index: int) -> None:
        from dqsgd.policies import state_from_dict

        if d["numel"] != self.numel:
            raise ValueError(f"bucket {index}: the checkpoint holds {d['numel']} elements, the model's bucket "
                             f"{self.numel} (same model and bucket_cap_mb needed)")
        fed = d.get("down_residual")  # the shard this rank serves: one of the bucket's shards
        if fed is not None:
            lengths = sorted({hi - lo for lo, hi in self.bounds})
            check_residuals({0: fed}, None, f"bucket {index}", "down_residual")
            if fed.numel() not in lengths:
                raise ValueError(f"bucket {index}: malformed state, 'down_residual' has {fed.numel()} elements, "
                                 f"a shard of this bucket {' or '.join(map(str, lengths))}")
        if tuple(d["sizes"]) != self.sizes:
            warnings.warn(f"bucket {index}: parameter order {self.sizes} differs from the checkpoint's "
                          f"{tuple(d['sizes'])} "
                          "(DDP orders a new model's first buckets by registration): this step's roundings differ "
                          "from an uninterrupted run's; the policy and its budget continue exactly", stacklevel=4)
            self.residuals, self.down_residual = {}, None
        self.policy = state_from_dict(type(self.policy), d["policy"])
        self.step = int(d["step"])
        if tuple(d["sizes"]) == self.sizes:
            self.residuals = dict(d["residuals"])
            self.down_residual = d.get("down_residual")  # absent: saved without the error-fed downlink
        self.generator.set_state(d["generator"])
        self.pending = [(s, torch.tensor(v, dtype=torch.float32), b, g, None) for s, v, b, g in d["pending"]]
