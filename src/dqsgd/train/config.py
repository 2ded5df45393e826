"""Typed run configuration, TOML files and dotted command-line overrides.

A config file has a ``[train]`` table (:class:`TrainConfig`) and a ``[methods.NAME]`` table per
method to compare (each an override set for :func:`dqsgd.methods.method_config`, plus the
optimizer keys ``lr``/``momentum`` a method may override). Overrides are ``section.key=value``
strings with TOML values (``train.steps=200``, ``methods.qsgd-4bit.bits=3``). Unknown sections
and keys, and values of the wrong type, are refused with a message naming them (the file checks,
overrides and shipped-config lookup are :mod:`dqsgd.config`'s, shared with :mod:`dqsgd.dq.config`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from dqsgd.config import (  # ConfigError, load_raw, shipped_configs: also public names of this module
    ConfigError, ConfigSchema, apply_overrides as _apply_overrides, coerce, load_raw, shipped_configs)
from dqsgd.methods import FIELDS as METHOD_FIELDS, MethodConfig, method_config
from dqsgd.topology.names import TOPOLOGIES

DEVICES = ("auto", "cpu", "cuda")


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
    threads: int = 0                  # torch intra-op threads; 0 = PyTorch's default. 1 is much faster
                                      # for small models when other processes share the cores (measured)
    tensorboard: bool = False         # also log to TensorBoard, in RUN_DIR/tensorboard (JSONL stays the record)
    tensorboard_dir: str = ""         # ... or under this folder, as DIR/LABEL/seedK (--tensorboard DIR)
    vmap_workers: bool = False        # the local workers' gradients in one torch.func.vmap call: 1.1-1.2x
                                      # faster for LeNet/MLP at W = 8 (measured), equal to ~1e-7 relative,
                                      # not bitwise (so not equal to one worker per process); no BatchNorm
    device: str = "auto"              # the simulation's device: "auto" (CUDA when available) | "cpu" | "cuda"
    topology: str = ""                # "ps" | "allgather" | "sharded"; "" = the transport's default
                                      # (simulation: ps; torch: sharded)
    downlink_bits: int = 8            # sharded: width of the downlink's stochastic rounding (2..16; 32 = fp32)
    downlink_feedback: bool = False   # sharded: each shard server keeps its downlink rounding's residual and
                                      # adds it next step (needed below 4 bits; docs/topologies.md)
    allow_unsafe_downlink: bool = False  # run downlink_bits < 4 without feedback anyway (may diverge)
    coded_every: int = 1              # measure the uplink's size with the best coding (AUTO) on the steps
                                      # n % coded_every == 0; 0 = never. A measurement: nothing sent changes

    def __post_init__(self) -> None:
        checks = [
            (self.workers >= 1, "workers must be >= 1"), (self.steps >= 1, "steps must be >= 1"),
            (self.batch_size >= 1, "batch_size must be >= 1"), (0 < self.lr < math.inf, "lr must be finite and > 0"),
            (0 <= self.momentum < 1, "momentum must be in [0, 1)"), (0 <= self.weight_decay < math.inf, "weight_decay must be finite and >= 0"),
            (self.lr_schedule in ("constant", "cosine"), "lr_schedule must be 'constant' or 'cosine'"),
            (self.eval_every >= 1, "eval_every must be >= 1"), (len(self.seeds) >= 1, "seeds must not be empty"),
            (self.on_nonfinite in ("raise", "skip"), "on_nonfinite must be 'raise' or 'skip'"),
            (self.device in DEVICES, f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}"),
            (self.topology in ("", *TOPOLOGIES), f"topology must be one of {', '.join(TOPOLOGIES)}"),
            (2 <= self.downlink_bits <= 16 or self.downlink_bits == 32, "downlink_bits must be in [2, 16] or 32 (fp32)"),
            (self.checkpoint_every >= 0 and self.subset >= 0 and self.eval_samples >= 0 and self.threads >= 0
             and self.pad_to >= 0 and self.coded_every >= 0,
             "counts must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"train: {msg}")


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


@dataclass(frozen=True)
class MethodEntry:
    """One method of a comparison: its validated config and optimizer overrides."""

    label: str
    config: MethodConfig
    lr: float | None = None
    momentum: float | None = None


@dataclass(frozen=True)
class ExperimentConfig:
    train: TrainConfig
    methods: tuple[MethodEntry, ...] = field(default_factory=tuple)
    source: str = ""


SCHEMA = ConfigSchema(("train",), ConfigError, unknown_keys="unknown {where} key(s) {bad}; allowed: {allowed}")


def build_experiment(raw: dict[str, Any], source: str = "") -> ExperimentConfig:
    SCHEMA.check_sections(raw)
    train = SCHEMA.table(TrainConfig, raw, "train")
    entries = []
    for label, opts in SCHEMA.methods(raw):
        base = opts.pop("method", label)
        lr, mom = opts.pop("lr", None), opts.pop("momentum", None)
        bad = sorted(set(opts) - set(METHOD_FIELDS))
        if bad:
            raise ConfigError(f"methods.{label}: unknown key(s) {bad}; allowed: method, lr, momentum, {', '.join(METHOD_FIELDS)}")
        try:
            cfg = method_config(base, **opts)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"methods.{label}: {e}") from None
        lr = None if lr is None else coerce(f"methods.{label}.lr", lr, 0.0)
        mom = None if mom is None else coerce(f"methods.{label}.momentum", mom, 0.0)
        entries.append(MethodEntry(label, cfg, lr, mom))
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
