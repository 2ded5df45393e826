"""Local SGD rows of the shaped-link benchmark (bench_network.py).

* ``local-hH[-METHOD]``: dqsgd's :class:`~dqsgd.train.local_sgd.LocalSGDOptimizer` — every rank trains its own
  copy of the model with SGD (the benchmark's lr and momentum); every H steps the pseudo-gradient
  Δ = θ_start − θ is compressed by the dqsgd method METHOD (default ``sgd``: fp32 payloads) and
  exchanged on the sharded topology, and the decoded average is applied (outer SGD, lr 1: model
  averaging). Budgeted methods plan over ⌈steps / H⌉ rounds.
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
                "= fp32, on the sharded topology) | postlocal-hH (PyTorch's PostLocalSGDOptimizer with a "
                "PeriodicModelAverager of period H, fp32)")
PREFIXES = ("local-h", "postlocal-h")


def local_row(method: str) -> tuple[str, int, str | None] | None:
    """(``"local"`` or ``"postlocal"``, H, the dqsgd method or None) of a Local SGD row; None otherwise."""
    for prefix in PREFIXES:
        if not method.startswith(prefix):
            continue
        period, _, name = method.removeprefix(prefix).partition("-")
        if not period.isdigit() or int(period) < 1:
            return None
        kind = prefix.removesuffix("-h")
        if kind == "postlocal":
            return None if name else (kind, int(period), None)
        return kind, int(period), name or "sgd"
    return None


def local_problem(method: str) -> str:
    """Why ``method`` is not a Local SGD row this benchmark can run ("" if it is)."""
    row = local_row(method)
    if row is None:
        return f"{method!r}: a Local SGD row is {LOCAL_SYNTAX}"
    if row[2] is not None:
        from dqsgd.method.config import method_config

        try:
            method_config(row[2])
        except (ValueError, TypeError, KeyError) as e:
            return f"{method!r}: {row[2]!r} is not a dqsgd method ({e})"
    return ""


def local_stepper(a: argparse.Namespace, data: Any, build: Callable[[], Any]) -> tuple[Any, Any, Any]:
    """(one training step of rank ``a.rank`` at step n, the model to evaluate, the optimizer) of a Local
    SGD row; ``build()`` makes the benchmark's model (seeded here, the same on every rank)."""
    import torch

    from dqsgd.train.sampling import MODEL_INIT, seed_for

    kind, period, name = local_row(a.method) or ("", 0, None)
    torch.manual_seed(seed_for(a.seed, MODEL_INIT))
    model = build()
    inner = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    if kind == "postlocal":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        opt: Any = PostLocalSGDOptimizer(inner, PeriodicModelAverager(period=period, warmup_steps=0))
    else:
        from dqsgd.train.local_sgd import LocalSGDOptimizer

        opt = LocalSGDOptimizer(inner, model, local_steps=period, method=name or "sgd",
                                rounds=math.ceil(a.steps / period), seed=a.seed, timeout=a.timeout)
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
