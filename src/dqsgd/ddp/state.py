"""State of the DDP hook: per-bucket methods and policies, traffic counters, checkpointing.

One :class:`HookState` per DDP model (like ``PowerSGDState``). A bucket index gets its own
:class:`~dqsgd.method.pipeline.Method` (the policy of the whole bucket) and, under topology ``sharded``,
one Method per shard (shard j of the bucket is a vector of its own: a per-tensor layout becomes the
pieces of the tensors inside the shard, a bucket layout restarts at the shard's start).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from dqsgd.core.ranges import check_count, check_rate, check_seed, check_timeout
from dqsgd.core.timeouts import HOOK_COLLECTIVE_S
from dqsgd.method.config import MethodConfig, check_one_message, method_config
from dqsgd.topology.names import FP32, HOOK_TOPOLOGIES as TOPOLOGIES, check_topology

if TYPE_CHECKING:
    from dqsgd.method.pipeline import Method
    from dqsgd.topology.bucket import BucketProtocol
    from dqsgd.topology.downspec import DownlinkSpec

STATE_VERSION = 2


# The hook's groups are also held here, for the life of the process: the completion callbacks capture
# them, and were a callback to drop the last reference (the state gone once the training function
# returned) the group's destructor would run on one of its own gloo threads and join it ("terminate
# called … Resource deadlock avoided", seen as a rank dying with SIGABRT at the end of a run).
_LIVE_GROUPS: list[dist.ProcessGroup] = []


class CompressionStats(NamedTuple):
    bytes_sent: int         # this rank's bytes to other ranks, headers, flags and padding included
    fp32_bytes: int         # 4 bytes per gradient element handled (the paper's reference)
    ratio: float            # fp32_bytes / bytes_sent (the project's definition of compression ratio)
    mean_bits: float        # uplink code width per coordinate, averaged over every element handled
    steps: int              # backward passes (calls on the last bucket)
    bytes_received: int = 0  # this rank's bytes from other ranks, padding included
    allreduce_bytes: int = 0  # sent + received by a ring all-reduce of the buckets in their own dtype
    total_ratio: float = math.nan  # allreduce_bytes / (bytes_sent + bytes_received)


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes``: 2·(W−1)/W·nbytes."""
    return 2 * (world - 1) * nbytes // world


@dataclass
class BucketState:
    """One bucket index: its protocol (methods, shards, keys), policy state, error-feedback residuals
    and step counter."""

    numel: int
    proto: BucketProtocol                # the bucket's per-step protocol (dqsgd.topology.bucket)
    policy: Any                          # the policy's state; .bits = this step's width
    generator: torch.Generator           # TernGrad's rounding (the other schemes draw hash uniforms)
    sizes: tuple[int, ...]               # the bucket's parameter sizes, in DDP's order
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    staged: dict[int, torch.Tensor] | None = None  # this step's new residuals, kept once no rank overflowed
    down_residual: torch.Tensor | None = None      # error-fed downlink: this rank's shard server residual e_j
    down_staged: torch.Tensor | None = None        # this step's new e_j, kept once no rank overflowed
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

    def record(self, avg: torch.Tensor, step: int, spent_bits: int, bad: torch.Tensor) -> None:
        """Keep the statistics of step ``step``'s averaged bucket; ``bad``: some rank's bucket was
        non-finite (the policy then skips the step). A policy that reads G keeps only what it reads
        (the coded budget: its entropy sample, ≤ 65,536 coordinates, not a copy of the bucket). On a
        device they are reduced there and copied to pinned host memory without blocking; an event
        marks when they have arrived."""
        from dqsgd.policies.base import grad_norms
        from dqsgd.policies.coded import read_stride

        m = self.method
        vals = torch.cat([grad_norms(avg, m.p), bad.to(torch.float32).reshape(1)])
        policy = self.proto.policy
        keep = avg[:: read_stride(policy, avg.numel())] if policy.needs_grad else None
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


def _stateful(field_name: str) -> bool:
    """Fields a saved state depends on (the method, its topology and horizon); warm-up, seed and the
    ratio threshold may change on resume."""
    return field_name.startswith("method.") or field_name in ("topology", "downlink_bits", "downlink_feedback",
                                                              "downlink_coding", "downlink_target_bits", "total_steps")


_COUNTERS = ("bytes_sent", "bytes_received", "fp32_bytes", "allreduce_bytes", "bit_coords", "coords", "steps")


class HookState:
    """State of :func:`dqsgd.ddp.hook` for one DDP model (one per model, like ``PowerSGDState``)."""

    __slots__ = ("config", "process_group", "seed", "timeout", "total_steps", "topology", "downlink_bits",
                 "downlink_feedback", "allow_unsafe_downlink", "downlink_coding", "downlink_target_bits", "nonfinite_step", "start_iter", "min_compression_rate",
                 "iter", "_buckets", "_groups", "_loaded", "_issued", "_agreed", "_queued", "_error", "_futures",
                 *_COUNTERS)

    def __init__(self, method: str | MethodConfig = "qsgd", process_group: dist.ProcessGroup | None = None,
                 seed: int = 0, timeout: float | None = HOOK_COLLECTIVE_S, total_steps: int = 1000, *,
                 topology: str = "sharded", downlink_bits: int | str | None = None, start_iter: int = 0,
                 min_compression_rate: float = 1.0, downlink_feedback: bool = False,
                 allow_unsafe_downlink: bool = False, downlink_coding: str | None = None,
                 downlink_target_bits: float = 0.0):
        """``method``: a registered name (``"qsgd"``, ``"qsgd-4bit"``, ``"dqsgd"``, …) or a config;
        ``process_group``: None = the default group; ``seed`` of the quantization randomness;
        ``timeout``: seconds any collective of the hook may take (None: torch's default);
        ``total_steps``: the horizon N of dynamic policies (budgeted DQSGD spreads its budget over N);
        ``topology``: ``"sharded"`` (reduce-scatter of payloads + quantized all-gather) or ``"allgather"``;
        ``downlink_bits``: width of the sharded downlink (2..16) or ``"fp32"``; below 4 bits only with
        ``downlink_feedback`` (each shard server keeps its rounding residual and adds it next step) or
        ``allow_unsafe_downlink`` (as is: may diverge); or ``"auto"`` (budgeted policies, sharded): each
        bucket's policy picks the uplink and downlink widths of every step from one both-leg budget
        (:mod:`dqsgd.policies.split`; widths below 4 only with ``downlink_feedback``); None: ``"auto"``
        for a budgeted method on ``"sharded"``, else 8;
        ``downlink_coding``: the quantized downlink's coding (``"fixed"``, ``"auto"``, ``"rans"``, …;
        :mod:`dqsgd.topology.downlink`); None: the uplink's (``dqsgd-coded``: ``"auto"``, else fixed);
        ``downlink_target_bits`` (``downlink_bits = "auto"``): the downlink's share of the both-leg budget,
        bits per coordinate and step (0: an 8-bit fixed downlink's cost);
        ``start_iter``: backward passes sent as a plain all-reduce first (``start_powerSGD_iter``);
        ``min_compression_rate``: a bucket whose predicted ratio (bytes in its dtype / payload bytes)
        is below this is all-reduced as is."""
        if isinstance(method, str):
            method = method_config(method)  # raises ValueError naming the registered methods
        if not isinstance(method, MethodConfig):
            raise TypeError("method must be a method name or a dqsgd.method.config.MethodConfig, "
                            f"got {type(method).__name__}")
        check_one_message(method, "the DDP hook")  # whatever min_compression_rate says
        check_seed("seed", seed)
        check_timeout("timeout", timeout)
        check_count("total_steps (the policy horizon N)", total_steps, 1)
        check_count("start_iter", start_iter, 0)
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError("process_group must be a torch.distributed ProcessGroup or None, "
                            f"got {type(process_group).__name__}")
        check_topology(topology, TOPOLOGIES)
        for name, flag in (("downlink_feedback", downlink_feedback), ("allow_unsafe_downlink", allow_unsafe_downlink)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        from dqsgd.topology.downspec import resolve_downlink

        spec = resolve_downlink(FP32 if downlink_bits == "fp32" else downlink_bits, downlink_coding, downlink_feedback,
                                downlink_target_bits, allow_unsafe_downlink, policy=method.policy,
                                uplink_coding=method.coding, vote=method.aggregate == "majority", topology=topology)
        dbits, self.downlink_coding, self.downlink_target_bits = spec.bits, spec.coding, spec.target_bits
        check_rate("min_compression_rate", min_compression_rate)
        self.config, self.process_group, self.seed = method, process_group, seed
        self.timeout, self.total_steps, self.topology = timeout, total_steps, topology
        self.downlink_bits = dbits
        self.downlink_feedback, self.allow_unsafe_downlink = downlink_feedback, allow_unsafe_downlink
        self.nonfinite_step: int | None = None  # the first step some rank's bucket was NaN/Inf (said once)
        self.start_iter, self.min_compression_rate, self.iter = start_iter, float(min_compression_rate), 0
        self._buckets: dict[int, BucketState] = {}
        self._loaded: dict[int, dict[str, Any]] = {}
        self._groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
        self._issued: torch.futures.Future | None = None  # the last bucket's downlink collective is issued
        self._agreed = False  # the ranks compared their fingerprints (first call of the hook)
        self._queued = False  # the end-of-backward callback that raises a bucket's error is queued
        self._error: Exception | None = None  # the first error a bucket's callback met in this backward
        self._futures: list[torch.futures.Future] = []  # this backward's bucket futures
        for name in _COUNTERS:
            setattr(self, name, 0)

    # --- reporting ------------------------------------------------------------------------------
    def compression_stats(self) -> CompressionStats:
        ratio = self.fp32_bytes / self.bytes_sent if self.bytes_sent else math.nan
        traffic = self.bytes_sent + self.bytes_received
        total = self.allreduce_bytes / traffic if traffic else math.nan
        mean = self.bit_coords / self.coords if self.coords else math.nan
        return CompressionStats(self.bytes_sent, self.fp32_bytes, ratio, mean, self.steps, self.bytes_received,
                                self.allreduce_bytes, total)

    def current_bits(self) -> dict[int, int]:
        """The width each bucket index used in its last step (a dynamic policy applies its next choice
        when the bucket next arrives)."""
        return {i: b.bits for i, b in sorted(self._buckets.items())}

    def current_downlink_bits(self) -> dict[int, int]:
        """The downlink width each bucket index's next step uses (``downlink_bits = "auto"``: its
        policy's choice; else the fixed width)."""
        return {i: b.proto.down_width(b.policy) for i, b in sorted(self._buckets.items())}

    def count(self, sent: int, received: int, numel: int, itemsize: int, width: int, world: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        self.fp32_bytes += 4 * numel
        self.allreduce_bytes += 2 * ring_bytes(numel * itemsize, world)
        self.bit_coords += width * numel
        self.coords += numel

    def fields(self) -> dict[str, Any]:
        """Everything the ranks must share, by name: the method and every option, the topology, the
        codings, the downlink width, warm-up, the policy horizon, the seed and the dqsgd version
        (the rank fingerprint, and the configuration a checkpoint must be loaded into)."""
        from dqsgd import __version__

        out = {f"method.{k}": v for k, v in dataclasses.asdict(self.config).items()}
        out.update({"topology": self.topology, "downlink_bits": self.downlink_bits,
                    "downlink_feedback": self.downlink_feedback, "downlink_coding": self.downlink_coding,
                    "downlink_target_bits": self.downlink_target_bits,
                    "start_iter": self.start_iter,
                    "min_compression_rate": self.min_compression_rate, "total_steps": self.total_steps,
                    "seed": self.seed, "dqsgd_version": __version__})
        return out

    def agree(self) -> None:
        """Compare :meth:`fields` and the progress (``iter``, backward passes so far: ranks resumed from
        different states differ) across the hook's ranks once (a fixed-size all-gather on the uplink
        group): every rank raises the same RankDisagreement naming the fields that differ."""
        from dqsgd.topology.agreement import agree

        if self._agreed:
            return
        up, _ = self.groups()

        def gather(ints: list[int]) -> list[list[int]]:
            mine = torch.tensor(ints, dtype=torch.int64)
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(up))]
            dist.all_gather(rows, mine, group=up)
            return [r.tolist() for r in rows]

        agree({**self.fields(), "progress.iter": self.iter}, gather, dist.get_rank(up))
        self._agreed = True

    # --- lazily built pieces --------------------------------------------------------------------
    def groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """Two groups over the hook's ranks, with the hook's timeout: uplink (collectives issued by
        the hook, in bucket order) and downlink (issued from completion callbacks, in bucket order)."""
        if self._groups is None:
            ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
            kw = {"timeout": timedelta(seconds=self.timeout)} if self.timeout is not None else {}
            self._groups = (dist.new_group(ranks, use_local_synchronization=True, **kw),
                            dist.new_group(ranks, use_local_synchronization=True, **kw))
            _LIVE_GROUPS.extend(self._groups)
        return self._groups

    def bucket(self, index: int, grad: torch.Tensor, sizes: list[int], rank: int, world: int) -> BucketState:
        """The bucket's state, built on first use. DDP rebuilds its buckets after the first iteration:
        a bucket of another size starts afresh; the same elements in another parameter order keep
        their policy and step (new layouts; error-feedback residuals restart, their positions moved)."""
        from dqsgd.topology.keys import worker_generator

        b, n = self._buckets.get(index), grad.numel()
        sizes = sizes if sum(sizes) == n else [n]
        if b is not None and b.numel == n:
            if b.sizes != tuple(sizes):
                b.proto = self._protocol(index, n, sizes, world)
                b.sizes, b.residuals, b.down_residual = tuple(sizes), {}, None
            return b
        proto = self._protocol(index, n, sizes, world)
        b = self._buckets[index] = BucketState(n, proto, proto.policy.init(),
                                               worker_generator(self.seed, rank, index), tuple(sizes))
        if index in self._loaded:
            b.load(self._loaded.pop(index), index)
        return b

    def _protocol(self, index: int, n: int, sizes: list[int], world: int) -> BucketProtocol:
        """The bucket's protocol; uniform quantization always draws hash uniforms (kernel "fused"), so
        a CPU and a GPU send the same bytes."""
        from dqsgd.topology.bucket import BucketProtocol, replace_kernel

        return BucketProtocol(replace_kernel(self.config, "fused"), n, sizes, topology=self.topology, workers=world,
                              seed=self.seed, total_steps=self.total_steps, bucket=index,
                              spec=self.downlink)

    @property
    def downlink(self) -> DownlinkSpec:
        """The downlink as ``__init__`` resolved it, carried to every bucket's protocol."""
        from dqsgd.topology.downspec import DownlinkSpec

        return DownlinkSpec(self.downlink_bits, self.downlink_coding, self.downlink_feedback, self.downlink_target_bits)

    # --- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed job needs to continue exactly: per-bucket policy states (the budget
        ledger of budgeted DQSGD), residuals, generator states, step counters; traffic counters."""
        buckets = {i: b.state_dict() for i, b in self._buckets.items()}
        return {"version": STATE_VERSION, "method": self.config.name, "fields": self.fields(), "iter": self.iter,
                "counters": {k: getattr(self, k) for k in _COUNTERS}, "buckets": {**self._loaded, **buckets}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; bucket states apply when DDP first calls the hook on them."""
        from dqsgd.topology.agreement import check_state, refuse_changed

        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a dqsgd HookState state_dict (version {STATE_VERSION})")
        check_state(state, {"fields": dict, "iter": int, "counters": dict, "buckets": dict}, "HookState state_dict")
        check_state(state["counters"], dict.fromkeys(_COUNTERS, int), "HookState state_dict counters")
        # older states: no feedback, a fixed downlink
        refuse_changed("state_dict", state["fields"], self.fields(), _stateful,
                       {"downlink_feedback": False, "downlink_coding": "fixed", "downlink_target_bits": 0.0})
        self.iter = int(state["iter"])
        for k in _COUNTERS:
            setattr(self, k, state["counters"][k])
        self._buckets, self._loaded = {}, dict(state["buckets"])
        self._agreed = False  # the ranks compare their progress again at the next backward

    def __getstate__(self) -> dict[str, Any]:
        """Pickling keeps the configuration and :meth:`state_dict`, not the process group (as PowerSGD)."""
        init = {k: getattr(self, k) for k in ("config", "seed", "timeout", "total_steps", "topology",
                                              "start_iter", "min_compression_rate", "downlink_feedback",
                                              "allow_unsafe_downlink", "downlink_coding", "downlink_target_bits")}
        init["downlink_bits"] = "fp32" if self.downlink_bits == 32 else self.downlink_bits
        return {"init": init, "state": self.state_dict()}

    def __setstate__(self, d: dict[str, Any]) -> None:
        init = dict(d["init"])
        config = init.pop("config")
        self.__init__(config, None, **{k: init.pop(k) for k in ("seed", "timeout", "total_steps")}, **init)
        self.load_state_dict(d["state"])
