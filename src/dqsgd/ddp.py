"""A DDP communication hook that sends dqsgd-quantized gradients (PyTorch's comm-hook style).

    model = DistributedDataParallel(net)
    state = dqsgd.ddp.HookState(method="dqsgd", process_group=None)
    model.register_comm_hook(state, dqsgd.ddp.hook)
    ...                                   # train as usual
    print(state.compression_stats())      # measured: fp32 bytes / bytes sent

For every gradient bucket, each rank encodes the bucket's flat gradient with the method's quantizer
and codec (:class:`dqsgd.pipeline.Method`, built lazily per bucket index with the bucket's size),
the variable-length payloads are all-gathered (sizes first, see :mod:`dqsgd.transport.torch_dist`),
and every rank decodes all W payloads in worker order and averages them (or takes the majority
vote), so all ranks hold bitwise the same averaged gradient. This is the peer topology of DQSGD
Algorithm 2: no rank is special. Dynamic policies (DQSGD, Adaptive, AdaQS) see the aggregated
gradient of the bucket and pick the bucket's next width, identically on every rank.

Randomness: stochastic rounding on rank r, bucket b draws from its own generator seeded with
``(seed, QUANT, r, b)`` (kernel "fused": the hash uniforms of ``(seed_for(seed, QUANT, b), step, r)``)
— not shared across ranks, reproducible for a given seed. The NCCL path is
the same code: payloads travel as uint8 tensors on the bucket's device; decoding runs on the CPU.
Note: DDP rebuilds its buckets after the first iteration; a bucket index whose size changes gets a
fresh method (the policy restarts from B_0).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time
# (bucket: dist.GradBucket, return: torch.futures.Future[torch.Tensor]).
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from dqsgd.methods import MethodConfig, method_config
from dqsgd.pipeline import Method, MethodState
from dqsgd.train.sampling import QUANT, seed_for
from dqsgd.transport.torch_dist import TorchAllGatherTransport

__all__ = ["CompressionStats", "HookState", "hook"]


class CompressionStats(NamedTuple):
    bytes_sent: int         # this rank's uplink payload bytes (+ TernGrad's shared scalers), measured
    fp32_bytes: int         # what plain fp32 all-reduce input would be: 4 bytes per gradient element
    ratio: float            # fp32_bytes / bytes_sent (the project's definition of compression ratio)
    mean_bits: float        # code width per coordinate, averaged over every element sent
    steps: int              # backward passes (calls on the last bucket)


@dataclass
class _Bucket:
    """One bucket index's method, policy state, quantization generator and step counter."""

    method: Method
    state: MethodState
    generator: torch.Generator
    step: int = 0


class HookState:
    """State of :func:`hook` for one DDP model (one per model, like PowerSGDState)."""

    __slots__ = ("config", "process_group", "seed", "timeout", "total_steps", "_buckets", "_transport",
                 "bytes_sent", "fp32_bytes", "bit_coords", "coords", "steps")

    def __init__(self, method: str | MethodConfig = "qsgd", process_group: dist.ProcessGroup | None = None,
                 seed: int = 0, timeout: float | None = 300.0, total_steps: int = 1000):
        """``method``: a registered name (``"qsgd"``, ``"qsgd-4bit"``, ``"dqsgd"``, ``"terngrad"``, …) or a
        config; ``process_group``: None = the default group; ``seed`` of the quantization generators;
        ``timeout``: seconds any collective of the hook may take (None: the group's own timeout);
        ``total_steps``: the horizon N of dynamic policies (budgeted DQSGD spreads its budget over N)."""
        if isinstance(method, str):
            method = method_config(method)  # raises ValueError naming the registered methods
        if not isinstance(method, MethodConfig):
            raise TypeError(f"method must be a method name or a dqsgd.methods.MethodConfig, got {type(method).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds (or None for the process group's), got {timeout!r}")
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps (the policy horizon N) must be an integer >= 1, got {total_steps!r}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got {type(process_group).__name__}")
        self.config, self.process_group, self.seed = method, process_group, seed
        self.timeout, self.total_steps = timeout, total_steps
        self._buckets: dict[int, _Bucket] = {}
        self._transport: TorchAllGatherTransport | None = None
        self.bytes_sent = self.fp32_bytes = self.bit_coords = self.coords = self.steps = 0

    def compression_stats(self) -> CompressionStats:
        ratio = self.fp32_bytes / self.bytes_sent if self.bytes_sent else float("nan")
        mean = self.bit_coords / self.coords if self.coords else float("nan")
        return CompressionStats(self.bytes_sent, self.fp32_bytes, ratio, mean, self.steps)

    def current_bits(self) -> dict[int, int]:
        """The width each bucket index will use next."""
        return {i: b.state.bits for i, b in sorted(self._buckets.items())}

    # --- lazily built pieces --------------------------------------------------------------------
    def transport(self, device: torch.device) -> TorchAllGatherTransport:
        if self._transport is None or self._transport.device != device:
            self._transport = TorchAllGatherTransport(self.process_group, device, self.timeout, check_agreement=False)
        return self._transport

    def bucket(self, index: int, grad: torch.Tensor, sizes: list[int], rank: int, world: int) -> _Bucket:
        b = self._buckets.get(index)
        if b is None or b.method.numel != grad.numel():
            sizes = sizes if sum(sizes) == grad.numel() else [grad.numel()]
            m = Method(self.config, grad.numel(), self.total_steps, sizes)
            gen = b.generator if b is not None else torch.Generator(device=grad.device)
            if b is None:
                gen.manual_seed(seed_for(self.seed, QUANT, rank, index))
            b = self._buckets[index] = _Bucket(m, m.init_state(world), gen)
        return b


def _encode(state: HookState, b: _Bucket, index: int, flat: torch.Tensor, rank: int,
            t: TorchAllGatherTransport) -> tuple[bytes, int]:
    """This rank's payload for the bucket, and the side bytes it also sent (TernGrad's scalers)."""
    m, scalers, side, extra = b.method, None, 0, {}
    if m.shares_scalers:  # TernGrad: per-tensor scalers max-reduced before quantizing
        scalers = t.max_reduce([m.local_scalers(flat)])
        side = 4 * scalers.numel()
    if getattr(m, "fused", False):  # kernel "fused": counter-based uniforms of (seed, step, worker)
        from dqsgd.kernels import HashRNG

        extra["hash_rng"] = HashRNG(seed_for(state.seed, QUANT, index), b.step, rank)
    payload, b.state.residuals[rank] = m.encode(flat, b.state.bits, b.generator, b.state.residuals[rank], scalers,
                                                **extra)
    return payload, side


def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Quantize, all-gather, decode and average one gradient bucket (register with ``register_comm_hook``)."""
    grad = bucket.buffer()
    t = state.transport(grad.device)
    rank, index = t.rank, bucket.index()
    b = state.bucket(index, grad, [p.numel() for p in bucket.parameters()], rank, t.workers)
    m, bits = b.method, b.state.bits
    flat = grad.detach().reshape(-1).to(torch.float32)
    payload, side = _encode(state, b, index, flat, rank, t)
    payloads = t.all_gather_bytes(payload, f"bucket {index} all_gather")
    avg = m.aggregate(payloads, bits)  # every rank: same bytes, same order -> same tensor
    if m.config.dynamic:  # fixed widths need no statistics (saves a pass over the bucket)
        b.state = m.observe(b.state, avg, b.step, 8 * max(len(p) for p in payloads))
    b.step += 1
    width = bits if m.config.scheme == "uniform" else m.config.nominal_bits()
    state.bytes_sent += len(payload) + side
    state.fp32_bytes += 4 * flat.numel()
    state.bit_coords += width * flat.numel()
    state.coords += flat.numel()
    state.steps += int(bucket.is_last())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(avg.to(device=grad.device, dtype=grad.dtype).reshape(grad.shape))
    return fut
