"""State of the DDP hook: its configuration, one bucket state per bucket index, traffic counters,
checkpointing.

One :class:`HookState` per DDP model (like ``PowerSGDState``). A bucket index gets its own
:class:`~dqsgd.topology.state.BucketState` (its protocol, policy, step and this rank's memory), the
state the exchange (:mod:`dqsgd.topology.exchange`) runs on.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dqsgd.core.comm_stats import CompressionStats
from dqsgd.core.ranges import check_count, check_rate, check_seed, check_timeout
from dqsgd.core.timeouts import HOOK_COLLECTIVE_S
from dqsgd.method.config import MethodConfig, check_fed_policy, check_one_message, method_config
from dqsgd.topology.names import FP32, check_topology
from dqsgd.topology.registry import PROCESSES_DEFAULT, REGISTRY, ring_bytes, topology_of

if TYPE_CHECKING:
    from dqsgd.topology.bucket import BucketProtocol
    from dqsgd.topology.downspec import DownlinkSpec
    from dqsgd.topology.group import TorchGroup
    from dqsgd.topology.state import BucketState

STATE_VERSION = 2


_COUNT_LOCK = threading.Lock()
_COUNTERS = ("bytes_sent", "bytes_received", "fp32_bytes", "allreduce_bytes", "bit_coords", "coords", "steps",
             "down_sent", "down_received", "refusals")  # bytes_*: both phases; down_*: the downlink's part


class HookState:
    """State of :func:`dqsgd.ddp.hook` for one DDP model (one per model, like ``PowerSGDState``)."""

    __slots__ = ("config", "process_group", "seed", "timeout", "total_steps", "topology", "downlink",
                 "nonfinite_step", "start_iter", "min_compression_rate", "uncompressed_dtype",
                 "iter", "link", "_init", "_buckets", "_group", "_loaded", "_agreed", "_queued", "_error", "_futures",
                 *_COUNTERS)

    def __init__(self, method: str | MethodConfig = "qsgd", process_group: dist.ProcessGroup | None = None,
                 seed: int = 0, timeout: float | None = HOOK_COLLECTIVE_S, total_steps: int = 1000, *,
                 topology: str = PROCESSES_DEFAULT, downlink_bits: int | str | None = None, start_iter: int = 0,
                 min_compression_rate: float = 1.0, downlink_feedback: bool = False,
                 allow_unsafe_downlink: bool = False, downlink_coding: str | None = None,
                 downlink_target_bits: float = 0.0, uncompressed_dtype: str | None = None):
        """``method``: a registered name (``"qsgd"``, ``"qsgd-4bit"``, ``"dqsgd"``, …) or a config;
        ``process_group``: None = the default group; ``seed`` of the quantization randomness;
        ``timeout``: seconds any collective of the hook may take (None: torch's default);
        ``total_steps``: the horizon N of dynamic policies (budgeted DQSGD spreads its budget over N);
        ``topology``: ``"sharded"`` (reduce-scatter of payloads + quantized all-gather) or ``"allgather"``;
        ``downlink_bits``: width of the sharded downlink (2..16) or ``"fp32"``; below 4 bits only with
        ``downlink_feedback`` (each shard server keeps its rounding residual and adds it next step) or
        ``allow_unsafe_downlink`` (as is: may diverge); or ``"auto"`` (budgeted policies, sharded): each
        bucket's policy picks the uplink and downlink widths of every step from one both-leg budget
        (:mod:`dqsgd.policies.split`; widths below 4 only with ``downlink_feedback``; the link policy,
        ``dqsgd-link``: its time model's choice); None: ``"auto"`` for a budgeted method or ``dqsgd-link``
        on ``"sharded"``, else 8;
        ``downlink_coding``: the quantized downlink's coding (``"fixed"``, ``"auto"``, ``"rans"``, …;
        :mod:`dqsgd.topology.downlink`); None: the uplink's (``dqsgd-coded``: ``"auto"``, else fixed);
        ``downlink_target_bits`` (``downlink_bits = "auto"``): the downlink's share of the both-leg budget,
        bits per coordinate and step (0: an 8-bit fixed downlink's cost);
        ``start_iter``: backward passes sent as a plain all-reduce first (``start_powerSGD_iter``);
        ``min_compression_rate``: a bucket whose predicted ratio (bytes in its dtype / payload bytes)
        is below this is all-reduced as is;
        ``uncompressed_dtype`` (the link policy, ``dqsgd-link``): the dtype a bucket the policy sends
        uncompressed is all-reduced in, ``"float16"`` or ``"bfloat16"`` (None: the bucket's own dtype);
        the policy prices that choice at its bytes."""
        self._init = {k: v for k, v in locals().items() if k not in ("self", "process_group")}  # what pickling keeps
        if isinstance(method, str):
            method = method_config(method)  # raises ValueError naming the registered methods
        if not isinstance(method, MethodConfig):
            raise TypeError("method must be a method name or a dqsgd.method.config.MethodConfig, "
                            f"got {type(method).__name__}")
        check_one_message(method, "the DDP hook")  # whatever min_compression_rate says
        if method.policy == "link" and not topology_of(topology).feeds_norms:
            check_fed_policy(method, f"the DDP hook on topology {topology!r}")
        from dqsgd.policies.linktime import check_uncompressed_dtype

        check_uncompressed_dtype(uncompressed_dtype, method.name, method.policy)
        check_seed("seed", seed)
        check_timeout("timeout", timeout)
        check_count("total_steps (the policy horizon N)", total_steps, 1)
        check_count("start_iter", start_iter, 0)
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError("process_group must be a torch.distributed ProcessGroup or None, "
                            f"got {type(process_group).__name__}")
        check_topology(topology, [n for n, t in REGISTRY.items() if t.hook])  # a topology registered later too
        from dqsgd.topology.downspec import downlink_of

        if downlink_bits is None and method.policy == "link" and topology_of(topology).sharded:
            downlink_bits = "auto"  # the link policy chooses the downlink's width too (docs/ddp-hook.md)
        options = {**self._init, "downlink_bits": FP32 if downlink_bits == "fp32" else downlink_bits}  # downlink_*
        self.downlink: DownlinkSpec = downlink_of(options, method, topology)  # carried to every bucket's protocol
        check_rate("min_compression_rate", min_compression_rate)
        self.config, self.process_group, self.seed = method, process_group, seed
        self.timeout, self.total_steps, self.topology = timeout, total_steps, topology
        self.nonfinite_step: int | None = None  # the first step some rank's bucket was NaN/Inf (said once)
        self.start_iter, self.min_compression_rate, self.iter = start_iter, float(min_compression_rate), 0
        self.uncompressed_dtype = uncompressed_dtype
        # (Mbit/s, latency s, the codec's cost over AUTO's model) measured at the first call (link_mbit 0)
        self.link: tuple[float, float, float] | None = None
        self._buckets: dict[int, BucketState] = {}
        self._loaded: dict[int, dict[str, Any]] = {}
        self._group: TorchGroup | None = None
        self._agreed = False  # the ranks compared their fingerprints (first call of the hook)
        self._queued: int | None = None  # the backward whose end-of-backward callback is queued (its id)
        self._error: Exception | None = None  # the first error a bucket's callback met in this backward
        self._futures: list[torch.futures.Future] = []  # this backward's bucket futures
        for name in _COUNTERS:
            setattr(self, name, 0)

    # --- reporting ------------------------------------------------------------------------------
    def compression_stats(self) -> CompressionStats:
        """This rank's traffic since the state was made (docs/api.md, "Statistics"); a round is a backward pass."""
        return CompressionStats(
            uplink_sent=self.bytes_sent - self.down_sent, uplink_received=self.bytes_received - self.down_received,
            downlink_sent=self.down_sent, downlink_received=self.down_received, fp32_bytes=self.fp32_bytes,
            dense_bytes=self.allreduce_bytes, mean_bits=self.bit_coords / self.coords if self.coords else math.nan,
            steps=self.steps, rounds=self.steps, refusals=self.refusals)

    def __repr__(self) -> str:
        down = "fp32" if self.downlink_bits == FP32 else self.downlink_bits
        return (f"<HookState method={self.config.name!r} ({self.config.budget_text()}), topology={self.topology}, "
                f"downlink={down if topology_of(self.topology).sharded else 'none'}, total_steps={self.total_steps}, "
                f"steps={self.steps}>")

    @property
    def pending_error(self) -> Exception | None:
        """The first error a bucket met in this backward (a refused payload, a failed collective), which
        the hook raises at the end of backward(); None when there is none."""
        return self._error

    def current_bits(self) -> dict[int, int]:
        """The width each bucket index used in its last step (a dynamic policy applies its next choice
        when the bucket next arrives)."""
        return {i: b.bits for i, b in sorted(self._buckets.items())}

    def current_downlink_bits(self) -> dict[int, int]:
        """The downlink width each bucket index's next step uses (``downlink_bits = "auto"``: its
        policy's choice; else the fixed width)."""
        return {i: b.proto.down_width(b.policy) for i, b in sorted(self._buckets.items())}

    def count(self, up: tuple[int, int], down: tuple[int, int], numel: int, itemsize: int, width: int, world: int,
              refused: bool = False) -> None:
        """One bucket's exchange: (sent, received) in the uplink and the downlink phase; ``refused``:
        sent uncompressed (warm-up, too small, not worth compressing). Called from completion callbacks too."""
        with _COUNT_LOCK:
            self.bytes_sent += up[0] + down[0]
            self.bytes_received += up[1] + down[1]
            self.down_sent += down[0]
            self.down_received += down[1]
            self.refusals += int(refused)
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
        out.update({"topology": self.topology, **self.downlink.fields(), "start_iter": self.start_iter,
                    "min_compression_rate": self.min_compression_rate, "total_steps": self.total_steps,
                    "uncompressed_dtype": self.uncompressed_dtype,
                    "seed": self.seed, "dqsgd_version": __version__})
        return out

    def agree(self, bucket: Any = None) -> None:
        """Compare :meth:`fields` and the progress (``iter``, backward passes so far: ranks resumed from
        different states differ) across the hook's ranks once (a fixed-size all-gather on the uplink
        group): every rank raises the same RankDisagreement naming the fields that differ. The link policy on
        a measured link (``link_mbit`` 0) then measures it, and ``bucket``'s step (:mod:`dqsgd.topology.probe`)."""
        from dqsgd.topology.agreement import agree
        from dqsgd.topology.group import gather_ints

        if self._agreed:
            return
        group = self.group()
        agree({**self.fields(), "progress.iter": self.iter}, partial(gather_ints, group), group.rank)
        if self.config.policy == "link" and not self.config.link_mbit and bucket is not None:  # none in flight yet
            from dqsgd.topology.probe import measure_hook

            self.link = measure_hook(self, group, bucket)
        self._agreed = True

    # --- lazily built pieces --------------------------------------------------------------------
    def group(self) -> TorchGroup:
        """The hook's ranks, over two groups of its own with the hook's timeout (one per leg: the
        uplink's collectives are issued by the hook in bucket order, the downlink's from completion
        callbacks in bucket order)."""
        if self._group is None:
            from dqsgd.topology.group import TorchGroup

            self._group = TorchGroup(self.process_group, self.timeout)
        return self._group

    def bucket(self, index: int, grad: torch.Tensor, sizes: list[int], rank: int, world: int) -> BucketState:
        """The bucket's state, built on first use. DDP rebuilds its buckets after the first iteration:
        a bucket of another size starts afresh; the same elements in another parameter order keep
        their policy and step (new layouts; error-feedback residuals restart, their positions moved)."""
        from dqsgd.topology.bucket import worker_generator
        from dqsgd.topology.state import BucketState

        b, n = self._buckets.get(index), grad.numel()
        sizes = sizes if sum(sizes) == n else [n]
        if b is not None and b.numel == n:
            if b.sizes != tuple(sizes):
                b.proto = self.protocol(index, n, sizes, world, grad.dtype)
                b.sizes, b.residuals, b.down_residual = tuple(sizes), {}, None
            return b
        proto = self.protocol(index, n, sizes, world, grad.dtype)
        b = self._buckets[index] = BucketState(numel=n, proto=proto, policy=proto.policy.init(),
                                               generator=worker_generator(self.seed, rank, index), sizes=tuple(sizes))
        if index in self._loaded:
            b.load(self._loaded.pop(index), index)
        return b

    def protocol(self, index: int, n: int, sizes: list[int], world: int, dtype: torch.dtype) -> BucketProtocol:
        """The bucket's protocol; uniform quantization always draws hash uniforms (kernel "fused"), so
        a CPU and a GPU send the same bytes. The link policy may also send the bucket uncompressed
        (:meth:`send_dtype`) and prices the hook's downlink (:meth:`LinkPolicy.sending`)."""
        from dqsgd.policies.link import LinkPolicy
        from dqsgd.policies.linktime import UNCOMPRESSED, on_measured
        from dqsgd.topology.bucket import BucketProtocol, replace_kernel

        config = on_measured(replace_kernel(self.config, "fused"), self.link)  # the same figures on every rank
        proto = BucketProtocol(config, n, sizes, topology=self.topology, workers=world,
                               seed=self.seed, total_steps=self.total_steps, bucket=index,
                               spec=self.downlink)
        proto.charge_side()  # a budget pays the size tables, as the trainer's (one engine, the same widths)
        if isinstance(proto.policy, LinkPolicy):  # "auto": the widths the protocol lets it choose among (None)
            quantized = topology_of(self.topology).sharded and self.downlink_bits != FP32
            down = None if proto.auto else int(self.downlink_bits) if quantized else UNCOMPRESSED
            proto.policy = proto.policy.sending(self.send_dtype(dtype).itemsize, down, self.link)
        return proto

    def send_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the link policy's uncompressed bucket of ``dtype`` is all-reduced in."""
        return dtype if self.uncompressed_dtype is None else getattr(torch, self.uncompressed_dtype)

    @property
    def downlink_bits(self) -> int | str:
        """The downlink's width as resolved (2..16, 32 = fp32, or ``"auto"``)."""
        return self.downlink.bits

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
        from dqsgd.topology.downspec import BEFORE, DownlinkSpec

        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a dqsgd HookState state_dict (version {STATE_VERSION})")
        check_state(state, {"fields": dict, "iter": int, "counters": dict, "buckets": dict}, "HookState state_dict")
        check_state(state["counters"], dict.fromkeys(_COUNTERS, int), "HookState state_dict counters")
        # the fields a saved state depends on (the method, its topology, downlink and horizon; warm-up, seed and the
        # ratio threshold may change on resume); older states: no feedback, a fixed downlink
        stateful = ("topology", "total_steps", *DownlinkSpec().fields())
        refuse_changed("state_dict", state["fields"], self.fields(), lambda f: f.startswith("method.") or f in stateful,
                       BEFORE)
        self.iter = int(state["iter"])
        for k in _COUNTERS:
            setattr(self, k, state["counters"].get(k, 0))  # older states: no downlink share, no refusals
        self._buckets, self._loaded = {}, dict(state["buckets"])
        self._agreed = False  # the ranks compare their progress again at the next backward

    def __getstate__(self) -> dict[str, Any]:
        """Pickling keeps the constructor's arguments and :meth:`state_dict`, not the process group (as PowerSGD)."""
        return {"init": self._init, "state": self.state_dict()}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__init__(**d["init"])  # type: ignore[misc]
        self.load_state_dict(d["state"])
