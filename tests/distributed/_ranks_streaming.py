"""Functions run inside the processes of test_local_streaming_processes.py (importable, so spawned ranks
unpickle them): LocalSGDOptimizer with fragments and overlap."""

from __future__ import annotations

import threading
from typing import Any

import _ranks_local
from _ranks_local import flat, make, train

from dqsgd.train.local_sgd import _Stream


def optimizer_runs(rank: int, world: int) -> dict[str, Any]:
    """(a) the streaming path forced at F = 1, τ = 0 and the unfragmented optimizer; (b) F = 4, τ = 2: the
    link bytes of every step, and a run resumed from a state dict cut while an exchange is in flight."""
    out: dict[str, Any] = {}
    model, opt = make(rank, 4, "qsgd-4bit", 4)
    train(rank, model, opt, 0, 16)
    out["plain"] = (flat(model), opt.link_bytes, opt.compression_stats())
    model, opt = make(rank, 4, "qsgd-4bit", 4)
    sizes = [p.numel() for p in opt.params]
    opt.stream = _Stream(opt, opt.method.config, sizes, 1, 0, 4, 0, opt.downlink)
    train(rank, model, opt, 0, 16)
    out["forced"] = (flat(model), opt.link_bytes, opt.compression_stats())
    per_step = {}
    for f, tau in ((1, 0), (4, 2)):
        model, opt = make(rank, 4, "qsgd-4bit", 4, fragments=f, overlap=tau)
        threads: list[str] = []
        for fr in opt.stream.frags if opt.stream else []:  # where each exchange runs
            run = fr.runner.run
            fr.runner.run = lambda *a, _run=run, **k: (threads.append(threading.current_thread().name), _run(*a, **k))[1]
        out[f"threads{f}"] = threads
        steps = []
        for n in range(16):
            before = opt.link_bytes
            train(rank, model, opt, n, n + 1)
            steps.append(opt.link_bytes - before)
        per_step[f] = (steps, [fr.b - fr.a for fr in opt.stream.frags] if opt.stream else [sum(sizes)],
                       opt.rounds_done, opt.stream.frags[0].method.max_payload_bytes(4) if opt.stream else None)
    out["per_step"] = per_step
    out["resume"] = _ranks_local.resume(rank, world, 4, 16, 7, "qsgd-2bit", {"fragments": 4, "overlap": 2,
                                                                            "error_feedback": True})
    return out
