"""Local SGD rows of the shaped-link benchmark (bench_network.py).

* ``local-hH[-METHOD]``: dqsgd's :class:`~dqsgd.train.local_sgd.LocalSGDOptimizer` — every rank trains its own
  copy of the model with SGD (the benchmark's lr and momentum); every H steps the pseudo-gradient
  Δ = θ_start − θ is compressed by the dqsgd method METHOD (default ``sgd``: fp32 payloads) and
  exchanged on the sharded topology, and the decoded average is applied (outer SGD, lr 1: model
  averaging). Budgeted methods plan over ⌈steps / H⌉ rounds.
* ``CONFIG:LABEL[+KEY=VALUE...]``: the same optimizer as the ``[methods.LABEL]`` table of the dqsgd
  config CONFIG (a shipped name such as ``local-fashion-1500``, or a path) sets it up, read by the trainer's
  config loader: its method and options, H (``local_steps``), outer step (``outer_optimizer``, ``outer_lr``,
  ``outer_momentum``: DiLoCo's Nesterov), streaming rounds (``fragments``, ``overlap_steps``) and downlink
  (``downlink_bits``, ``downlink_coding``, ``downlink_feedback``: the error-fed downlink). ``+KEY=VALUE``
  overrides one key of that table (TOML value), e.g.
  ``local-fashion-1500:diloco-h32-lr1-m05-dqsgd-coded-ef3+local_steps=16+fragments=3+overlap_steps=4``.
  The config's schedule and data (steps, lr, cosine decay, dataset) are not used: the bench's apply.
* ``postlocal-hH``: PyTorch's uncompressed peer, ``torch.distributed.optim.PostLocalSGDOptimizer``
  with a ``PeriodicModelAverager`` of period H (no warm-up): the same local SGD, then an fp32
  all-reduce of the parameters every H steps.

Both start from the benchmark's seeded initial weights and read the same data shards as its DDP rows;
neither wraps the model in DDP (it would all-reduce every step's gradients). Rank 0 evaluates its own
copy, which between exchanges is its local model, for both rows alike.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

LOCAL_SYNTAX = ("local-hH[-METHOD] (dqsgd's LocalSGDOptimizer: every H steps Δ compressed by METHOD, default sgd "
                "= fp32, on the sharded topology) | CONFIG:LABEL[+KEY=VALUE...] (LocalSGDOptimizer as the "
                "[methods.LABEL] table of the dqsgd config CONFIG sets it: method and options, local_steps, outer "
                "step, fragments, overlap_steps, downlink; +KEY=VALUE overrides one of its keys) | postlocal-hH "
                "(PyTorch's PostLocalSGDOptimizer with a PeriodicModelAverager of period H, fp32)")
PREFIXES = ("local-h", "postlocal-h")
# [train] keys of Local SGD a config row cannot honour here: the bench's inner optimizer is SGD, its period fixed
UNSUPPORTED = {"inner_optimizer": "sgd", "local_period": "fixed"}


def is_local(method: str) -> bool:
    """Whether ``method`` names a Local SGD row (well formed or not): ``local-``, ``postlocal-`` or ``CONFIG:LABEL``
    (a hook row's ``METHOD@DOWN:TARGET`` has its ``@`` before the colon)."""
    return is_config_row(method) or method.startswith(("local-", "postlocal-"))


def is_config_row(method: str) -> bool:
    return ":" in method and "@" not in method.partition(":")[0]


def local_row(method: str) -> tuple[str, int, Any] | None:
    """(``"local"`` or ``"postlocal"``, H, what the row runs) of a Local SGD row, None if ``method`` is not
    one: for ``local`` rows, the keywords of :class:`LocalSGDOptimizer` (``method``, ``outer`` …) and the inner
    optimizer's ``lr`` / ``momentum`` where the config's method sets them; for ``postlocal`` rows None.
    Raises ValueError for a config row (``CONFIG:LABEL[+KEY=VALUE...]``) its config refuses."""
    if is_config_row(method):
        return config_row(method)
    for prefix in PREFIXES:
        if not method.startswith(prefix):
            continue
        period, _, name = method.removeprefix(prefix).partition("-")
        if not period.isdigit() or int(period) < 1:
            return None
        kind = prefix.removesuffix("-h")
        if kind == "postlocal":
            return None if name else (kind, int(period), None)
        return kind, int(period), {"method": name or "sgd"}
    return None


def config_row(row: str) -> tuple[str, int, dict[str, Any]]:
    """A ``CONFIG:LABEL[+KEY=VALUE...]`` row: the config loaded by the trainer's loader, each ``+KEY=VALUE`` applied
    as its override ``methods.LABEL.KEY=VALUE``, and the method's own Local SGD keys (local_steps, outer_*,
    fragments, overlap_steps, downlink_*, topology) as :class:`LocalSGDOptimizer`'s keywords. Its ``[train]``
    schedule (steps, lr, lr_schedule, data, model) is not used: the bench's own apply, as to every row."""
    from dqsgd.train.config import load_experiment, resolve_downlink

    config, _, rest = row.partition(":")
    label, *sets = rest.split("+")
    exp = load_experiment(config, [f"methods.{label}.{s}" for s in sets])
    (entry,) = exp.select([label])
    train = entry.train_config(exp.train)
    for key, value in UNSUPPORTED.items():
        if getattr(train, key) != value:
            raise ValueError(f"{key} = {getattr(train, key)!r}: the bench's Local SGD rows run {key} = {value!r}")
    topology = train.topology or "sharded"
    down = resolve_downlink(train, entry.config, topology)
    if down.target_bits:
        raise ValueError("downlink_target_bits: LocalSGDOptimizer has no both-leg downlink budget")
    opts = {"method": entry.config, "outer": train.outer_optimizer, "outer_lr": train.outer_lr,
            "outer_momentum": train.outer_momentum, "topology": topology, "downlink_bits": down.bits,
            "downlink_coding": down.coding, "downlink_feedback": down.feedback, "fragments": train.fragments,
            "overlap": train.overlap_steps}
    inner = {k: v for k, v in (("lr", entry.lr), ("momentum", entry.momentum)) if v is not None}
    return "local", train.local_steps, {**opts, **inner}


def warmup_steps(method: str, warmup: int) -> int:
    """The untimed warm-up steps of a row asked for ``warmup``: a Local SGD row's cover its first exchange (H
    steps, and the τ its result waits), so that what the first exchange does once (compiling the coders,
    connecting the streaming process group) is not timed; a DDP row exchanges at every step already."""
    row = local_row(method) if warmup and is_local(method) else None
    return warmup if row is None else max(warmup, row[1] + (row[2] or {}).get("overlap", 0))


def local_problem(method: str) -> str:
    """Why ``method`` is not a Local SGD row this benchmark can run ("" if it is)."""
    try:
        row = local_row(method)
    except (ValueError, TypeError, KeyError) as e:  # the config loader's ConfigError is a ValueError
        return f"{method!r}: {e}"
    if row is None:
        return f"{method!r}: a Local SGD row is {LOCAL_SYNTAX}"
    if row[0] == "local" and isinstance(row[2]["method"], str):
        from dqsgd.method.config import method_config

        try:
            method_config(row[2]["method"])
        except (ValueError, TypeError, KeyError) as e:
            return f"{method!r}: {row[2]['method']!r} is not a dqsgd method ({e})"
    return ""


def local_stepper(a: argparse.Namespace, data: Any, build: Callable[[], Any]) -> tuple[Any, Any, Any]:
    """(one training step of rank ``a.rank`` at step n, the model to evaluate, the optimizer) of a Local
    SGD row; ``build()`` makes the benchmark's model (seeded here, the same on every rank)."""
    import torch

    from dqsgd.train.sampling import MODEL_INIT, seed_for

    kind, period, options = local_row(a.method) or ("", 0, None)
    torch.manual_seed(seed_for(a.seed, MODEL_INIT))
    model = build()
    options = dict(options or {})
    inner = torch.optim.SGD(model.parameters(), lr=options.pop("lr", a.lr), momentum=options.pop("momentum", a.momentum))
    if kind == "postlocal":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        opt: Any = PostLocalSGDOptimizer(inner, PeriodicModelAverager(period=period, warmup_steps=0))
    else:
        from dqsgd.train.local_sgd import LocalSGDOptimizer

        opt = LocalSGDOptimizer(inner, model, local_steps=period, rounds=math.ceil(a.steps / period), seed=a.seed,
                                timeout=a.timeout, **options)
    return training_step(a, data, model, opt), model, opt


def training_step(a: argparse.Namespace, data: Any, model: Any, opt: Any) -> Callable[[int], None]:
    """Step n of rank ``a.rank``: its minibatch of the benchmark's shards, cross-entropy, backward, ``opt``."""
    import torch.nn.functional as F

    from dqsgd.train.sampling import WorkerBatches

    batches = WorkerBatches(len(data.train.y), a.workers, a.batch_size, a.seed)

    def step(n: int) -> None:
        idx = batches.indices(a.rank, n)
        loss = F.cross_entropy(model(data.train.x[idx]), data.train.y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step
