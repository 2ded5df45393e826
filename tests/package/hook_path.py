"""The modules one DDP hook bucket passes through, in order, traced (``sys.settrace``) in one process.

``dqsgd.ddp.hook`` is called on one bucket of rank 0 of W = 2 as DDP would call it, its group a
loopback group (:class:`dqsgd.cli.bench.loopback.LoopbackGroup`: every collective completes at once
on this thread, so the completion callbacks run here and are traced too; the other rank's payloads
are replicas of this one's). The bucket's second step is traced (the first builds the bucket state
and the other shard server's message). Run ``python tests/package/hook_path.py`` to print the path.

Counted over the dqsgd modules only (torch's own frames are skipped; the loopback group's collectives,
which stand where the torch.distributed group's would be, and the GradBucket stand-in are not counted): the modules in order of first
entry, how many times execution moved (by a call or a return) to a module it had already left
(re-entries), and how many calls went up a layer (tests/package/test_layers.py's layers: callbacks).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

WORLD, N, METHOD = 2, 100_003, "qsgd-4bit"
STAND_INS = ("dqsgd.cli.bench.loopback", "dqsgd.fsdp.hsdp")  # for the process group and DDP's GradBucket


@dataclass
class BucketPath:
    moves: list[str]          # the module executing after each call or return, consecutive repeats merged
    first: list[str]          # the modules in order of first entry
    reentries: int            # moves to a module already left before
    up: int                   # calls into a module of a higher layer (a callback: DDP's, the count)


def trace_bucket(method: str = METHOD, topology: str = "sharded") -> BucketPath:
    """The path of one bucket through ``dqsgd.ddp.hook`` (module docstring)."""
    import dqsgd.ddp
    from dqsgd.cli.bench.loopback import LoopbackGroup, _Servers
    from dqsgd.ddp import comm_hook
    from dqsgd.fsdp.hsdp import ShardBucket

    hs = dqsgd.ddp.HookState(method, None, total_steps=10, topology=topology)
    grad = torch.randn(N, generator=torch.Generator().manual_seed(0))
    b, servers = hs.bucket(0, grad, [N], 0, WORLD), _Servers(0)  # the hook then finds the bucket's state
    servers.now = (0, b, grad, b.proto.down_width(b.policy))  # the other shard server's message, from grad
    hs._group = LoopbackGroup(WORLD, peers=servers)  # type: ignore[assignment]
    world = comm_hook.dist.get_world_size
    comm_hook.dist.get_world_size = lambda group=None: WORLD  # type: ignore[assignment]
    try:
        dqsgd.ddp.hook(hs, ShardBucket(0, grad.clone(), [N], last=True)).wait()
        moves: list[str] = []
        calls: list[bool] = []  # each move: a call (else a return)

        def where(frame: Any) -> str | None:
            name = frame.f_globals.get("__name__", "") if frame is not None else ""
            return name if name.startswith("dqsgd") and name not in STAND_INS else None

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            if event in ("call", "return"):
                m = where(frame if event == "call" else frame.f_back)
                if m is not None and (not moves or moves[-1] != m):
                    moves.append(m)
                    calls.append(event == "call")
            return tracer

        sys.settrace(tracer)
        try:
            dqsgd.ddp.hook(hs, ShardBucket(0, grad.clone(), [N], last=True)).wait()
        finally:
            sys.settrace(None)
    finally:
        comm_hook.dist.get_world_size = world  # type: ignore[assignment]
    sys.path.insert(0, str(Path(__file__).parent))
    from test_layers import layer_of

    first = list(dict.fromkeys(moves))
    up = sum(1 for a, b, call in zip(moves, moves[1:], calls[1:]) if call and (layer_of(b) or 0) > (layer_of(a) or 0))
    return BucketPath(moves, first, len(moves) - len(first), up)


if __name__ == "__main__":
    for topo in ("sharded", "allgather"):
        p = trace_bucket(topology=topo)
        print(f"{METHOD} {topo}, W = {WORLD}: {len(p.first)} modules, {len(p.moves) - 1} moves, "
              f"{p.reentries} re-entries, {p.up} calls up a layer")
        for i, m in enumerate(p.first, 1):
            print(f"  {i:2d}. {m}")
        folders = [m.split(".")[1] for m in p.moves]
        print("  folders:", " > ".join(f for i, f in enumerate(folders) if i == 0 or folders[i - 1] != f))
