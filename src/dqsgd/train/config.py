"""Typed run configuration, TOML files and dotted command-line overrides.

A config file has a ``[train]`` table (:class:`TrainConfig`) and a ``[methods.NAME]`` table per
method to compare (each an override set for :func:`dqsgd.method.config.method_config`, plus the
optimizer keys ``lr``/``momentum`` a method may override). Overrides are ``section.key=value``
strings with TOML values (``train.steps=200``, ``methods.qsgd-4bit.bits=3``). Unknown sections
and keys, and values of the wrong type, are refused with a message naming them (the file checks,
overrides and shipped-config lookup are :mod:`dqsgd.core.config_file`'s, shared with :mod:`dqsgd.dq.config`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, get_args

if TYPE_CHECKING:
    import torch

    from dqsgd.topology.downspec import DownlinkSpec

from dqsgd.core.config_file import (  # ConfigError, load_raw, shipped_configs: also public names of this module
    ConfigError, ConfigSchema, apply_overrides as _apply_overrides, check_name, coerce, load_raw, shipped_configs)
from dqsgd.core.ranges import LR_MAX, check_outer, check_seed
from dqsgd.method.config import FIELDS as METHOD_FIELDS, CodingName, MethodConfig, method_config
from dqsgd.topology.names import check_downlink_target
from dqsgd.topology.registry import REGISTRY
from dqsgd.train.schedule import check_streaming

DEVICES = ("auto", "cpu", "cuda")
THREADS_MAX = 1024    # torch.set_num_threads(100000) crashes the process
PAD_TO_MAX = 1024     # pad_to = 100000 asked for a 40 TB tensor


@dataclass(frozen=True)
class TrainConfig:
    name: str = "run"
    dataset: str = "mnist"
    data_root: str = ""               # "" = the dataset's default location
    subset: int = 0                   # >0: seeded stratified subset of the training set
    pad_to: int = 0                   # >0: images zero-padded (centred) to pad_to x pad_to (e.g. 32: CIFAR shape)
    model: str = "cnn"
    workers: int = 8                  # W
    steps: int = 500                  # N
    batch_size: int = 32              # per worker (K)
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0         # added to the gradient before quantization (part of the loss)
    lr_schedule: str = "constant"     # "constant" | "cosine"
    eval_every: int = 100             # steps between test evaluations (and one at the end)
    eval_samples: int = 0             # 0 = the whole test set
    seeds: tuple[int, ...] = (0,)
    checkpoint_every: int = 0         # 0 = no checkpoints
    on_nonfinite: str = "raise"       # "raise" | "skip" a step whose gradient has NaN/Inf
    max_len: int = 200                # text datasets: tokens per document
    threads: int = 1                  # torch intra-op threads; 0 = PyTorch's default (one per core). 1: the
                                      # simulation's tensors are small, and 2+ threads lose much when other
                                      # processes share the cores (docs/devices.md, dqsgd bench step --contention)
    tensorboard: bool = False         # also log to TensorBoard, in RUN_DIR/tensorboard (JSONL stays the record)
    tensorboard_dir: str = ""         # ... or under this folder, as DIR/LABEL/seedK (--tensorboard DIR)
    vmap_workers: bool = False        # the local workers' gradients in one torch.func.vmap call: 1.1-1.2x
                                      # faster for LeNet/MLP at W = 8 (measured), equal to ~1e-7 relative,
                                      # not bitwise (so not equal to one worker per process); no BatchNorm
    device: str = "auto"              # the simulation's device: "auto" (CUDA when available) | "cpu" | "cuda"
    topology: str = ""                # "ps" | "allgather" | "sharded"; "" = the transport's default
                                      # (simulation: ps; torch: sharded)
    downlink_bits: int | str = 0      # sharded: width of the downlink's rounding (2..16; 32 = fp32), or "auto":
                                      # chosen with the uplink's from one budget (budgeted policies). 0 = the
                                      # method's default: "auto" for dqsgd / dqsgd-coded on sharded, else 8
    downlink_feedback: bool = False   # sharded: each shard server keeps its downlink rounding's residual and
                                      # adds it next step (needed below 4 bits; docs/topologies.md)
    allow_unsafe_downlink: bool = False  # run downlink_bits < 4 without feedback anyway (may diverge)
    downlink_coding: str = ""         # sharded: the quantized downlink's coding (fixed, auto, rans, ...); "" =
                                      # the uplink's (dqsgd-coded: auto, entropy-coded; others: fixed)
    downlink_target_bits: float = 0.0  # downlink_bits "auto": the downlink's share of the both-leg budget, bits
                                      # per coordinate and step; 0 = an 8-bit fixed downlink's cost
    coded_every: int = 1              # measure the uplink's size with the best coding (AUTO) on the steps
                                      # n % coded_every == 0; 0 = never. A measurement: nothing sent changes
    # The simulated wall clock (dqsgd.train.slownodes): per-worker compute time, log-normal with median
    # compute_s and spread compute_sigma, plus a stall of stall_s with probability stall_prob; links of
    # link_mbps with link_latency_s per message round. backup_workers = b: the ps server aggregates the
    # first W - b arrivals of each step (simulation: by the time model; gloo: by arrival order).
    compute_s: float = 0.1
    compute_sigma: float = 0.25
    stall_prob: float = 0.02
    stall_s: float = 1.0
    link_mbps: float = 1000.0
    link_latency_s: float = 0.0005
    backup_workers: int = 0
    # Local SGD (docs/local-sgd.md): rounds of H inner steps per worker, then the pseudo-gradients
    # Δ_w = θ_start − θ_w are exchanged like gradients and an outer optimizer applies their average.
    local_steps: int = 1              # H; 1 with the defaults below = the per-step exchange of gradients
    local_period: str = "fixed"       # "fixed" | "adaptive": H_r shrinks from local_steps toward
                                      # local_steps_min as the round's training loss falls
    local_steps_min: int = 1          # adaptive: the smallest H
    inner_optimizer: str = "sgd"      # per worker within a round: "sgd" (lr, momentum) | "adamw" (lr, weight_decay)
    outer_optimizer: str = "sgd"      # on the averaged Δ: "sgd" | "nesterov" (DiLoCo)
    outer_lr: float = 1.0             # outer SGD with lr 1 and no momentum = plain model averaging
    outer_momentum: float = 0.0
    fragments: int = 1                # streaming rounds: the parameters in F fragments (whole tensors), fragment f
                                      # exchanged every H steps at offset f*H/F (docs/local-sgd.md); F <= H
    overlap_steps: int = 0            # streaming rounds: an exchange's result is applied tau < H inner steps after
                                      # it is issued (the exchange overlaps them); 0 = blocking
    partition: str = "iid"            # the workers' shards: "iid" | "dirichlet" (label-skewed)
    dirichlet_alpha: float = 0.5      # dirichlet: concentration α of each class's split over the workers

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.workers <= 4096, "workers must be in 1..4096"), (1 <= self.steps <= 10**9, "steps must be in 1..10^9"),
            (1 <= self.batch_size <= 1 << 20, "batch_size must be in 1..2^20"),
            (0 < self.lr <= LR_MAX, f"lr must be in (0, {LR_MAX:g}], got {self.lr!r}"),
            (self.threads <= THREADS_MAX, f"threads must be in 0..{THREADS_MAX} (0 = PyTorch's default), got {self.threads}"),
            (self.pad_to <= PAD_TO_MAX, f"pad_to must be in 0..{PAD_TO_MAX} pixels, got {self.pad_to}"),
            (1 <= self.max_len <= 1 << 20, "max_len must be in 1..2^20"),
            (0 <= self.momentum < 1, "momentum must be in [0, 1)"), (0 <= self.weight_decay < math.inf, "weight_decay must be finite and >= 0"),
            (self.lr_schedule in ("constant", "cosine"), "lr_schedule must be 'constant' or 'cosine'"),
            (self.eval_every >= 1, "eval_every must be >= 1"), (len(self.seeds) >= 1, "seeds must not be empty"),
            (self.on_nonfinite in ("raise", "skip"), "on_nonfinite must be 'raise' or 'skip'"),
            (self.device in DEVICES, f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}"),
            (self.topology == "" or self.topology in REGISTRY, f"topology must be one of {', '.join(REGISTRY)}"),
            (not isinstance(self.downlink_bits, bool) and (self.downlink_bits in (0, "auto", 32) or (
                isinstance(self.downlink_bits, int) and 2 <= self.downlink_bits <= 16)),
             f"downlink_bits must be in [2, 16], 32 (fp32), 'auto' or 0 (the method's default), got {self.downlink_bits!r}"),
            (self.downlink_coding in ("", *get_args(CodingName)),
             f"downlink_coding must be one of {', '.join(get_args(CodingName))} or '' (the uplink's), "
             f"got {self.downlink_coding!r}"),
            (self.checkpoint_every >= 0 and self.subset >= 0 and self.eval_samples >= 0 and self.threads >= 0
             and self.pad_to >= 0 and self.coded_every >= 0,
             "counts must be >= 0"),
        ]
        checks += [
            (0 <= self.backup_workers < self.workers, "backup_workers must be in [0, workers - 1]"),
            (0 <= self.compute_s < math.inf and 0 <= self.compute_sigma < math.inf and self.stall_s >= 0,
             "compute_s and compute_sigma must be finite and >= 0, stall_s >= 0"),
            (0 <= self.stall_prob <= 1, "stall_prob must be in [0, 1]"),
            (0 < self.link_mbps and 0 <= self.link_latency_s < math.inf,
             "link_mbps must be > 0 and link_latency_s finite and >= 0"),
        ]
        for ok, msg in checks + self._local_checks():
            if not ok:
                raise ConfigError(f"train: {msg}")
        try:  # the ranges shared with the hook, FSDP and the Local SGD wrapper (dqsgd.core.ranges)
            for seed in self.seeds:
                check_seed("seeds", seed)
            check_outer(self.outer_optimizer, self.outer_lr, self.outer_momentum)
            if self.streaming:
                check_streaming(self.fragments, self.overlap_steps, self.local_steps, overlap_name="overlap_steps")
            check_downlink_target(self.downlink_target_bits, auto=True)
        except ValueError as e:
            raise ConfigError(f"train: {e}") from None
        check_name("train.name", self.name)

    def _local_checks(self) -> list[tuple[bool, str]]:
        return [
            (self.local_steps >= 1, "local_steps must be >= 1"),
            (self.local_period in ("fixed", "adaptive"), "local_period must be 'fixed' or 'adaptive'"),
            (1 <= self.local_steps_min <= self.local_steps, "local_steps_min must be in [1, local_steps]"),
            (self.inner_optimizer in ("sgd", "adamw"), "inner_optimizer must be 'sgd' or 'adamw'"),
            (self.partition in ("iid", "dirichlet"), "partition must be 'iid' or 'dirichlet'"),
            (0 < self.dirichlet_alpha < math.inf, "dirichlet_alpha must be finite and > 0"),
            (not (self.local and self.vmap_workers), "vmap_workers needs one model for all workers: not with Local SGD"),
            (not (self.streaming and self.local_period != "fixed"),
             "fragments / overlap_steps need local_period = 'fixed'"),
        ]

    @property
    def local(self) -> bool:
        """Whether the run trains in rounds (Local SGD) rather than exchanging every step's gradient:
        any H > 1, an adaptive period, AdamW inside, or an outer optimizer other than plain averaging."""
        return (self.local_steps > 1 or self.local_period == "adaptive" or self.inner_optimizer != "sgd"
                or self.outer_optimizer != "sgd" or self.outer_lr != 1.0 or self.outer_momentum != 0.0 or self.streaming)

    @property
    def streaming(self) -> bool:
        """Whether the rounds run in fragments or overlap their exchanges (dqsgd.train.streaming)."""
        return self.fragments != 1 or self.overlap_steps != 0

    @property
    def rounds(self) -> int:
        """The number of exchanges the bit policy plans for: ``steps`` per-step, ⌈steps/H⌉ in rounds of
        a fixed H, and with an adaptive period the most it can take, ⌈steps/local_steps_min⌉."""
        if not self.local:
            return self.steps
        h = self.local_steps_min if self.local_period == "adaptive" else self.local_steps
        return -(-self.steps // h)


def resolve_device(name: str) -> "torch.device":
    """``train.device`` as the torch device a simulated run trains on: "auto" is the current CUDA
    device when CUDA is available, else the CPU.

    Raises:
      ConfigError: an unknown name, or "cuda" where CUDA is not available.
    """
    if name not in DEVICES:
        raise ConfigError(f"train: device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    import torch  # here, not at the top: `dqsgd --help` and `methods` read configs without torch

    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda', but CUDA is not available here (torch.cuda.is_available() is "
                          "False); use 'auto' or 'cpu'")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_downlink(cfg: TrainConfig, method: MethodConfig, topology: str) -> DownlinkSpec:
    """The downlink a run of ``method`` on ``topology`` uses (:func:`dqsgd.topology.downspec.downlink_of`
    with the ``[train]`` keys), every downlink key checked against them (a ``downlink_target_bits``
    without ``downlink_bits = "auto"``, e.g. on ``ps``, is refused): the trainer and ``--dry-run`` both
    call this."""
    from dqsgd.topology.downspec import downlink_of

    try:
        return downlink_of(cfg, method, topology, where="train.",
                           spell=("train.downlink_feedback = true", "train.allow_unsafe_downlink = true"))
    except ValueError as e:
        raise ValueError(f"{e} (topology {topology!r}, method {method.name!r})") from None


# [train] keys a [methods.LABEL] table may set for its own runs (a comparison of Local SGD periods,
# outer optimizers, topologies and downlink widths in one config file; a simulated comparison: the torch
# transport's topology is the run's).
METHOD_TRAIN_KEYS = ("local_steps", "local_period", "local_steps_min", "inner_optimizer", "outer_optimizer",
                     "outer_lr", "outer_momentum", "fragments", "overlap_steps", "downlink_bits", "downlink_coding",
                     "downlink_target_bits", "downlink_feedback", "topology")


@dataclass(frozen=True)
class MethodEntry:
    """One method of a comparison: its validated config, optimizer overrides and its own values of
    the Local SGD keys of ``[train]`` (:data:`METHOD_TRAIN_KEYS`)."""

    label: str
    config: MethodConfig
    lr: float | None = None
    momentum: float | None = None
    train: tuple[tuple[str, Any], ...] = ()

    def optimizer_momentum(self, cfg: TrainConfig) -> float:
        """The workers' optimizer momentum: this method's ``momentum``, else the method's own need (Sketched
        SGD with ``sketch_momentum`` keeps its momentum on the workers: 0), else ``[train]``'s."""
        if self.momentum is not None:
            return self.momentum
        return 0.0 if self.config.scheme == "sketch" and self.config.sketch_momentum else cfg.momentum

    def train_config(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` with this method's own ``[train]`` values."""
        if not self.train:
            return cfg
        try:
            return dataclasses.replace(cfg, **dict(self.train))
        except ConfigError as e:
            raise ConfigError(f"methods.{self.label}: {e}") from None


@dataclass(frozen=True)
class ExperimentConfig:
    train: TrainConfig
    methods: tuple[MethodEntry, ...] = field(default_factory=tuple)
    source: str = ""

    def select(self, only: list[str] | None) -> list[MethodEntry]:
        """The entries ``compare --methods`` selects (all without ``only``); refuses a label the config lacks."""
        check_selection([e.label for e in self.methods], only, self.source)
        return [e for e in self.methods if not only or e.label in only]


def check_selection(labels: list[str], only: list[str] | None, source: str = "") -> None:
    """Refuse a config without methods, and ``--methods`` labels it lacks (torch-free: the CLI checks
    the raw config's labels before building the methods, whose checks import torch)."""
    if not labels:
        raise ConfigError(f"{source or 'config'}: no [methods.NAME] tables: nothing to compare")
    missing = sorted(set(only or []) - set(labels))
    if missing:
        raise ConfigError(f"--methods {missing} not in the config; it has {labels}")


SCHEMA = ConfigSchema(("train",), ConfigError, unknown_keys="unknown {where} key(s) {bad}; allowed: {allowed}")


def build_experiment(raw: dict[str, Any], source: str = "") -> ExperimentConfig:
    SCHEMA.check_sections(raw)
    train = SCHEMA.table(TrainConfig, raw, "train")
    entries = []
    for label, opts in SCHEMA.methods(raw):
        base = opts.pop("method", label)
        lr, mom = opts.pop("lr", None), opts.pop("momentum", None)
        own = SCHEMA.fields(TrainConfig, f"methods.{label}", {k: opts.pop(k) for k in METHOD_TRAIN_KEYS if k in opts},
                            base=train)
        bad = sorted(set(opts) - set(METHOD_FIELDS))
        if bad:
            raise ConfigError(f"methods.{label}: unknown key(s) {bad}; allowed: method, lr, momentum, "
                              f"{', '.join(METHOD_TRAIN_KEYS)}, {', '.join(METHOD_FIELDS)}")
        try:
            cfg = method_config(base, **opts)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"methods.{label}: {e}") from None
        lr = None if lr is None else coerce(f"methods.{label}.lr", lr, 0.0)
        if lr is not None and not 0 < lr <= LR_MAX:
            raise ConfigError(f"methods.{label}.lr must be in (0, {LR_MAX:g}], got {lr!r}")
        mom = None if mom is None else coerce(f"methods.{label}.momentum", mom, 0.0)
        entry = MethodEntry(label, cfg, lr, mom, tuple(sorted(own.items())))
        entry.train_config(train)  # refused here, not when the run starts
        entries.append(entry)
    return ExperimentConfig(train, tuple(entries), source)


def apply_overrides(raw: dict[str, Any], overrides: list[str], sections: tuple[str, ...] = ("train",),
                    error: type[ValueError] = ConfigError) -> dict[str, Any]:
    """``section.key=value`` (TOML value; bare words are strings) applied to a raw config dict.

    ``sections`` are the plain tables a config has; ``methods.LABEL.KEY=VALUE`` is always accepted.
    Errors are raised as ``error`` (the caller's config error type).
    """
    return _apply_overrides(raw, overrides, sections, error)


def load_experiment(name_or_path: str, overrides: list[str] | None = None) -> ExperimentConfig:
    raw, source = load_raw(name_or_path)
    return build_experiment(apply_overrides(raw, overrides or []), source)
