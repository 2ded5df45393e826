"""Rank functions of tests/distributed/test_peer_limits.py (2 gloo ranks)."""

from __future__ import annotations

import resource
from typing import Any

import torch

from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.topology.sketched import SketchedStep
from dqsgd.transport import make_transport

D = 900


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sketch_forged_downlink(rank: int, world: int, size: int) -> dict[str, Any]:
    """M1: Sketched SGD on ps; the server's (rank 0's) candidates message claims ``size`` coordinates in
    its header (the message itself has the size every rank expects). Every rank refuses it before
    allocating anything of that count."""
    t = make_transport("ps", timeout=20.0)
    step = SketchedStep(Method(method_config("sketched-sgd", topk_ratio=0.01), D, 3), seed=1, topology="ps",
                        workers=world)
    if rank == 0:
        from dqsgd.codecs import sketch_wire
        from dqsgd.topology import sketched

        honest = sketched.encode_indices

        def forged(indices: torch.Tensor, d: int, values: torch.Tensor | None = None) -> bytes:
            real = honest(indices, d, values)
            head = sketch_wire._HEAD.pack(sketch_wire.MAGIC, sketch_wire.VERSION, sketch_wire.IndexKind.INDICES, d, size)
            return head + real[len(head):]

        sketched.encode_indices = forged  # type: ignore[assignment]
    grads = {rank: torch.randn(D, generator=torch.Generator().manual_seed(rank))}
    before = _rss_mb()
    try:
        step.run(t, grads, step.method.init_state(world), 0, {})
        kind, text = "ok", ""
    except Exception as e:  # noqa: BLE001 - the test reads the type and the text
        kind, text = type(e).__name__, str(e)
    return {"kind": kind, "text": text, "rss_growth_mb": _rss_mb() - before}
