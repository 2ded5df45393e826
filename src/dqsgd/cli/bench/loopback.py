"""The loopback DDP hook of ``dqsgd bench gpu``: the sharded hook's codec work of W ranks, in one process.

At world size 1 ``dqsgd.ddp.hook`` passes the gradient through (there is nothing to send), so no
single-GPU run shows its cost. :class:`LoopbackHook` is registered on a world-size-1 DDP model as
its comm hook, so DDP's own buckets, futures and overlap with backward are the real ones; for each
bucket it does what one rank of W does with its gradient in the sharded topology, with the hook's
own codec functions (:mod:`dqsgd.topology.payloads`) and shard methods:

1. the bucket is cut into the W shards of :func:`dqsgd.topology.step.shard_methods`; each shard is encoded
   (uplink, the step's width) — a real rank encodes all W shards too;
2. each shard's payload is "sent" to itself and decoded into that shard's average (a real rank
   decodes W payloads of its one shard: the same number of elements);
3. each shard's average is re-quantized for the downlink (8 bits, max norm) and decoded into the
   bucket (a real rank decodes the W downlink shards: the same number of elements).

So the loopback spends what a rank spends, minus the wire, plus one thing: it re-quantizes all W
shards for the downlink where a real rank re-quantizes its own 1/W (an upper bound, by an encode
of (W−1)/W of the bucket at 8 bits). Payload checks are deferred (the device flag ``bad``) and read
once per timing round, as the real hook reads them a step later. Widths: fixed for qsgd-4bit; for
dqsgd the method's policy observes each bucket's decoded gradient one step late, as the hook does.

:func:`loopback_bucket` is the one function that touches the hook's codec.
"""

import dataclasses  # no "from __future__ import annotations": DDP checks the hook's annotations as objects
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LoopbackHook", "ddp_times", "loopback_bucket", "loopback_hook"]

DOWNLINK_BITS = 8


def loopback_bucket(shards: list[Any], bounds: list[tuple[int, int]], flat: torch.Tensor, bits: int, step: int,
                    seeds: list[int], down_seed: int, bad: torch.Tensor | None) -> torch.Tensor:
    """The bucket after uplink, decode, downlink re-quantization and decode of every shard (module
    docstring), on ``flat.device``; ``bad`` (device path) collects the deferred payload checks."""
    from dqsgd.kernels import HashRNG
    from dqsgd.quantizers import Norm
    from dqsgd.topology import payloads as codec

    out = torch.zeros_like(flat)
    for j, (m, (lo, hi)) in enumerate(zip(shards, bounds)):
        payload, _ = codec.encode_shard(m, flat[lo:hi], bits, HashRNG(seeds[j], step, 0), None, None, None)
        avg = torch.zeros(hi - lo, dtype=torch.float32, device=flat.device)
        codec.accumulate(m, [payload], bits, avg, bad)
        down = codec.encode_downlink(m, avg, DOWNLINK_BITS, HashRNG(down_seed, step, j))
        codec.decode_accumulate_payload(down, out[lo:hi], max_numel=max(hi - lo, 1),
                                        expect=(DOWNLINK_BITS, Norm.MAX, m.layout), bad=bad)
    return out


@dataclasses.dataclass
class _Bucket:
    method: Any
    shards: list[Any]
    bounds: list[tuple[int, int]]
    state: Any  # the method's MethodState (policy)
    step: int = 0
    last: torch.Tensor | None = None  # the previous step's decoded bucket, observed one step late


class LoopbackHook:
    """The state of :func:`loopback_hook` (``model.register_comm_hook(h, loopback_hook)``): the sharded
    dqsgd hook's codec work for ``world`` virtual ranks (module docstring). ``method``: a method name
    (``qsgd-4bit``, ``dqsgd``)."""

    def __init__(self, method: str, world: int, total_steps: int = 1000, seed: int = 0) -> None:
        from dqsgd.method.config import method_config

        if world < 2:
            raise ValueError(f"the loopback plays W >= 2 ranks, got {world}")
        cfg = method_config(method)
        self.config = dataclasses.replace(cfg, kernel="fused") if cfg.quantizer.fused else cfg
        self.world, self.total_steps, self.seed = world, total_steps, seed
        self.buckets: dict[int, _Bucket] = {}
        self.bad: torch.Tensor | None = None

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The hook's work on one bucket; returns the completed future DDP waits for."""
        grad = bucket.buffer()
        flat = grad.reshape(-1)
        b = self._bucket(bucket.index(), flat.numel())
        self._observe(b)
        if self.bad is None and grad.device.type != "cpu":
            self.bad = torch.zeros((), dtype=torch.bool, device=grad.device)
        from dqsgd.core.rng import DOWNLINK, QUANT, seed_for

        seeds = [seed_for(self.seed, QUANT, bucket.index(), j) for j in range(self.world)]
        out = loopback_bucket(b.shards, b.bounds, flat.to(torch.float32), int(b.state.bits), b.step, seeds,
                              seed_for(self.seed, DOWNLINK, bucket.index()), self.bad)
        b.last, b.step = out, b.step + 1
        grad.copy_(out.view_as(grad))
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(grad)
        return fut

    def _bucket(self, index: int, n: int) -> _Bucket:
        b = self.buckets.get(index)
        if b is None or b.method.numel != n:
            from dqsgd.method.pipeline import Method, MethodState
            from dqsgd.topology.step import shard_methods

            bounds, shards = shard_methods(self.config, n, self.total_steps, [n], self.world)
            m = Method(self.config, n, self.total_steps, [n])
            b = self.buckets[index] = _Bucket(m, shards, bounds, MethodState(m.policy.init(), []))
        return b

    def _observe(self, b: _Bucket) -> None:
        """The policy sees the previous step's decoded bucket (the hook's one-step delay)."""
        if b.last is not None:
            spent = 8 * sum(m.message_bits(int(b.state.bits)) // 8 for m in b.shards)
            b.state = b.method.observe(b.state, b.last, b.step - 1, spent)
        b.last = None

    def check(self) -> None:
        """Raise if any deferred payload check failed (call after a synchronize)."""
        if self.bad is not None and bool(self.bad):
            raise RuntimeError("loopback: a payload failed its checks (crc, padding or code range)")


def loopback_hook(state: LoopbackHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: :meth:`LoopbackHook.run` of ``state``."""
    return state.run(bucket)


# ----------------------------------------------------------------------------------- DDP timing

HOOKS = ("none", "fp16", "powersgd-1", "qsgd-4bit", "dqsgd")


def build_model(name: str, width: int = 1024, layers: int = 8) -> tuple[torch.nn.Module, tuple[int, ...], bool]:
    """(model, input shape per sample, classifier?): ``resnet18`` at 3×32×32, or ``transformer``: a stack
    of ``layers`` encoder blocks of width ``width`` (1024 × 8: 100.8M parameters), sequences of 128."""
    torch.manual_seed(0)
    if name == "resnet18":
        from dqsgd.models import DatasetInfo, build_model as build

        return build("resnet18", DatasetInfo(num_classes=10, input_shape=(3, 32, 32))), (3, 32, 32), True
    if name in ("transformer", "transformer-small"):  # the small one: 2 blocks of width 64, for smoke tests
        width, layers = (width, layers) if name == "transformer" else (64, 2)
        block = torch.nn.TransformerEncoderLayer(width, max(width // 64, 1), 4 * width, dropout=0.0, batch_first=True)
        return torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False), (128, width), False
    raise ValueError(f"unknown model {name!r}: resnet18 or transformer")


def _register(model: Any, hook: str, world: int, total_steps: int) -> LoopbackHook | None:
    """PyTorch's hooks as ``dqsgd bench hook`` registers them; dqsgd's methods as the loopback."""
    if hook in ("none", "fp16", "powersgd-1"):
        from dqsgd.cli.bench.hook import register_hook as register_torch_hook

        register_torch_hook(model, hook, total_steps)
        return None
    loop = LoopbackHook(hook, world, total_steps)
    model.register_comm_hook(loop, loopback_hook)
    return loop


def _stepper(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor | None) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)

    def step() -> None:
        opt.zero_grad()
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y) if y is not None else out.float().pow(2).mean()
        loss.backward()
        opt.step()

    return step


def _compiles() -> int:
    """Graphs compiled by torch.compile plus Triton kernel variants compiled so far (a counter)."""
    import sys

    total = int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) if "torch._dynamo" in sys.modules else 0
    for name in ("dqsgd.kernels.triton_codec", "dqsgd.kernels.triton_crc"):
        mod = sys.modules.get(name)
        for k in (getattr(mod, a, None) for a in ("_encode_kernel", "_decode_kernel", "_absmax_kernel", "_crc_level")):
            caches = getattr(k, "device_caches", None)
            total += sum(len(c[0]) for c in caches.values()) if caches else 0
    return total


def _rounds(steppers: dict[str, Any], loops: dict[str, LoopbackHook | None], device: torch.device, rounds: int,
            steps: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict[str, list[float]] = {h: [] for h in steppers}
    peak: dict[str, float] = {h: 0.0 for h in steppers}
    for _r in range(rounds):
        for h, step in steppers.items():
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            for _s in range(steps):
                step()
            sync()
            times[h].append((time.perf_counter() - t) / steps)
            if cuda:
                peak[h] = max(peak[h], torch.cuda.max_memory_allocated(device) / 2**20)
            if loops[h] is not None:
                loops[h].check()
    return times, peak


def ddp_times(device: torch.device, models: list[str], worlds: list[int], rounds: int, steps: int,
              batch: int, hooks: tuple[str, ...] = HOOKS, warmup: int = 3) -> dict[str, Any]:
    """Loopback DDP step time of each hook per model and W, as a ratio to no hook in the same round
    (``batch`` images for resnet18, batch/8 sequences of 128 tokens for the transformers)."""
    import copy
    import statistics
    import tempfile

    from torch.nn.parallel import DistributedDataParallel as DDP

    own = not dist.is_initialized()
    if own:
        store = dist.FileStore(tempfile.mktemp(prefix="dqsgd-bench-gpu-"), 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    rows, recompiled = [], 0
    try:
        for name in models:
            net, shape, classify = build_model(name)
            g = torch.Generator().manual_seed(0)
            x = torch.randn(batch if classify else max(1, batch // 8), *shape, generator=g).to(device)
            y = torch.randint(0, 10, (batch,), generator=g).to(device) if classify else None
            for world in worlds:
                steppers, loops = {}, {}
                for h in hooks:
                    model = DDP(copy.deepcopy(net).to(device), device_ids=[device.index] if device.type == "cuda"
                                else None)
                    loops[h] = _register(model, h, world, warmup + rounds * steps + 1)
                    steppers[h] = _stepper(model, x, y)
                    for _ in range(warmup):
                        steppers[h]()
                before = _compiles()
                times, peak = _rounds(steppers, loops, device, rounds, steps)
                recompiled += _compiles() - before
                for h, ts in times.items():
                    r = [t / b for t, b in zip(ts, times["none"])]
                    rows.append({"model": name, "world": world, "hook": h, "ms": 1e3 * statistics.median(ts),
                                 "ratio": statistics.median(r), "min": min(r), "max": max(r),
                                 "peak_mb_over_none": peak[h] - peak["none"] if device.type == "cuda" else None})
    finally:
        if own:
            dist.destroy_process_group()
    return {"rows": rows, "recompilations": recompiled, "batch": batch, "rounds": rounds, "steps": steps}
