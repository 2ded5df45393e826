"""Where a DDP hook's step spends its CPU: thread CPU time per stage, per step, in each of 2 gloo ranks.

    PYTHONPATH=src python benchmarks/hook_stages.py ["dqsgd-coded sharded"] [--steps 12] [--hidden 1024,1024]
        [--downlink-bits 4]

The mlp of ``dqsgd bench hook`` (same batch), the hook registered as there; after 3 warm-up steps
the stages below are wrapped with a ``time.thread_time`` accumulator (CPU of the calling thread:
other jobs on a shared machine move it much less than wall time; stages nest, so the rows overlap)
and ``--steps`` steps are run. Printed per rank: the process's CPU per step, then each stage's CPU
ms per step and calls per step. A measurement tool, not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import collections
import copy
import importlib
import time
from typing import Any, Callable

import torch

# (module, attribute): what each stage is
STAGES = [
    ("dqsgd.ddp.comm_hook", "_encode_flagged"),  # uplink: quantize + code every shard (older versions)
    ("dqsgd.topology.exchange", "_Rank._encode"),  # uplink: quantize + code every shard
    ("dqsgd.method.pipeline", "Method.compress"),  # quantization alone (older versions of the coded path)
    ("dqsgd.kernels.codec", "_quantize"),  # quantization and, for the entropy codings, the level histogram
    ("dqsgd.topology.payloads", "messages"),  # the send buffer of payloads that are not written in place
    ("dqsgd.codecs.auto", "level_histogram"),  # AUTO's one pass over the levels (older versions)
    ("dqsgd.codecs.auto", "level_stats"),  # the same with the Elias length (older versions of AUTO)
    ("dqsgd.codecs.auto", "rans_encode"),  # AUTO's rANS encoder (older versions; now in a table)
    ("dqsgd.codecs.auto", "_zstd_may_win"),  # AUTO's zstd sample
    ("dqsgd.codecs.auto", "elias_bit_length"),  # AUTO's exact Elias length, where it is needed
    ("dqsgd.codecs.wire", "crc32"),
    ("dqsgd.ddp.comm_hook", "_sizes"),  # the size exchange of variable-length payloads (blocking; older versions)
    ("dqsgd.topology.exchange", "size_table"),  # the size exchange of variable-length payloads (issued)
    ("dqsgd.topology.bucket", "BucketProtocol.reduce"),  # uplink: decode + average this rank's shard
    ("dqsgd.codecs.wire", "decode_body"),
    ("dqsgd.codecs.wire", "decode_body_uncounted"),  # decode-accumulate's (RANSX: the table checked while adding)
    ("dqsgd.topology.bucket", "BucketProtocol.encode_down_fed"),  # downlink: the shard's payload
    ("dqsgd.ddp.comm_hook", "_assemble"),  # downlink: decode every shard, record the statistics (older versions)
    ("dqsgd.topology.exchange", "_Rank._assemble"),  # downlink: decode every shard
    ("dqsgd.topology.bucket", "BucketProtocol.decode_down"),
    ("dqsgd.topology.downlink", "encode_coded"),  # the entropy-coded downlink (downlink_coding)
    ("dqsgd.topology.downlink", "decode_coded"),
    ("dqsgd.ddp.state", "BucketState.record"),  # (older versions)
    ("dqsgd.ddp.state", "BucketState.catch_up"),  # the policy's update (older versions)
    ("dqsgd.topology.state", "BucketState.record"),  # the step's statistics
    ("dqsgd.topology.state", "BucketState.catch_up"),  # the policy's update
    ("dqsgd.policies.coded", "CodedBudgetedDQSGD.learn"),  # its level entropies
    ("dqsgd.policies.link", "LinkPolicy.update"),  # the link policy's choice (its statistics, its argmin)
    ("dqsgd.policies.link", "LinkPolicy.decide"),  # the argmin alone
    ("dqsgd.topology.exchange", "own_figures"),  # the link policy: this rank's ‖g‖² and rounding error
    ("dqsgd.topology.state", "BucketState.hand_workers"),  # the link policy: ‖G‖² of the workers' step
]
CPU: collections.defaultdict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def _timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def g(*a: Any, **k: Any) -> Any:
        t = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            CPU[name] += time.thread_time() - t
            CALLS[name] += 1
    return g


def _wrap_all() -> None:
    import dqsgd.codecs.auto as auto

    for mod, attr in STAGES:  # a stage this version of the code does not have is skipped
        owner: Any = importlib.import_module(mod)
        *cls, name = attr.split(".")
        for c in cls:
            owner = getattr(owner, c, None)
        if hasattr(owner, name):
            setattr(owner, name, _timed(attr, getattr(owner, name)))
    for coding, (enc, bounds) in list(getattr(auto, "_RANS", {}).items()):  # AUTO's rANS encoders, in a table
        auto._RANS[coding] = (_timed(f"{coding.name.lower()}_encode (AUTO)", enc), bounds)


def rank_stages(rank: int, world: int, hook: str, steps: int, hidden: tuple[int, ...] = (),
                down: int | None = None) -> tuple[float, dict[str, tuple[float, float]]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dqsgd.ddp
    from dqsgd.cli.bench.hook import CIFAR, _stepper, build, register_hook
    from dqsgd.models import MLP

    _wrap_all()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(128, *CIFAR, generator=g), torch.randint(0, 10, (128,), generator=g)
    torch.manual_seed(0)
    model = DDP(MLP(CIFAR, 10, hidden=hidden) if hidden else copy.deepcopy(build("mlp")))
    if down is None:
        register_hook(model, hook, total_steps=3 + steps + 1)
    else:  # a dqsgd hook with this downlink width (allowed below 4 bits, as the network bench's @DOWN)
        method, topology = hook.split()
        st = dqsgd.ddp.HookState(method, None, total_steps=3 + steps + 1, topology=topology, downlink_bits=down,
                                 allow_unsafe_downlink=True)
        model.register_comm_hook(st, dqsgd.ddp.hook)
    step = _stepper(model, x, y)
    for _ in range(3):
        step()
    CPU.clear()
    CALLS.clear()
    t = time.process_time()
    for _ in range(steps):
        step()
    per_step = (time.process_time() - t) / steps
    return per_step, {k: (1e3 * v / steps, CALLS[k] / steps) for k, v in CPU.items()}


def main() -> None:
    from dqsgd.cli.launch import spawn_local

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hook", nargs="?", default="dqsgd-coded sharded")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--hidden", default="", help="the mlp's hidden widths (default 580,580), e.g. 1024,1024")
    ap.add_argument("--downlink-bits", type=int, default=None, help="a dqsgd hook's downlink width (default: its own)")
    a = ap.parse_args()
    hidden = tuple(int(h) for h in a.hidden.split(",")) if a.hidden else ()
    for r, res in enumerate(spawn_local(rank_stages, 2, (a.hook, a.steps, hidden, a.downlink_bits))):
        if not res.ok:
            raise SystemExit(res.describe())
        per_step, stages = res.value
        print(f"rank {r}: {a.hook}: process CPU {1e3 * per_step:.1f} ms per step")
        for name, (ms, calls) in sorted(stages.items(), key=lambda kv: -kv[1][0]):
            print(f"  {name:36s} {ms:7.2f} ms  {calls:5.1f} calls per step")


if __name__ == "__main__":
    main()
