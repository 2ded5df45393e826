"""The uplink leg of the ``sharded`` protocol, as the FSDP reduce-scatter uses it.

Every call into the protocol is in this module: a unit is one
:class:`~dqsgd.topology.bucket.BucketProtocol` of topology ``sharded`` (the object the trainer's
steps, the torch transports and the DDP hook run), of which the reduce-scatter uses the uplink leg:
:meth:`~dqsgd.topology.bucket.BucketProtocol.encode` of this rank's W shard payloads, the exchange
of :meth:`dqsgd.transport.torch_dist.TorchShardedTransport.exchange` (sizes first, each checked
against :meth:`~dqsgd.topology.bucket.BucketProtocol.caps` before anything is allocated) and
:meth:`~dqsgd.topology.bucket.BucketProtocol.reduce` of this rank's shard (the mean, each payload
scaled by 1/W before it is added).

Unit u is the bucket 0 of a protocol seeded with ``unit_seed(seed, u)``: its keys are the trainer's
keys for a model of its own, so rank j's reduced shard is bitwise shard j of
:class:`dqsgd.topology.step.ShardedStep`'s update (downlink fp32) for the same gradients, seed and step.
"""

from __future__ import annotations

import datetime
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dqsgd.codecs import PayloadError
from dqsgd.method.pipeline import ProtocolError
from dqsgd.policies import GradStats
from dqsgd.topology.payloads import bytes_tensor, tensor_bytes

from dqsgd.transport.torch_dist import TorchShardedTransport, TransportError, make_transport

if TYPE_CHECKING:
    from dqsgd.fsdp.state import UnitState

REFUSAL_CAP = 1 << 12  # the most bytes of a refusing rank's error text that the others receive
STATS = 2  # per rank: max |G_j| (or Σ|G_j|^p for a finite p) and Σ G_j², sent as float32 like G's sample


class Done(dist.Work):
    """A finished collective (``async_op=True``): it ran before the call returned."""

    def wait(self, timeout=None) -> bool:  # type: ignore[no-untyped-def]
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


def transport(group: dist.ProcessGroup, timeout: float | None) -> TorchShardedTransport:
    return make_transport("sharded", group, torch.device("cpu"), timeout)  # type: ignore[return-value]


def payload_bytes(u: UnitState) -> int:
    """Predicted bytes of one rank's W fixed-coded shard payloads at this step's width."""
    return u.method.message_bits(u.method.width(u.bits)) // 8


def encode(u: UnitState, flat: torch.Tensor, rank: int,
           scalers: torch.Tensor | None) -> tuple[list[bytes], torch.Tensor | None]:
    """This rank's W shard payloads of ``flat`` (float32, CPU) and its new error-feedback residual."""
    P = u.protocol
    shards = None if u.residual is None else [u.residual[lo:hi] for lo, hi in P.bounds]
    pays, res = P.encode(rank, flat, u.bits, u.n, u.generator, shards, scalers)
    return [tensor_bytes(p) for p in pays], (None if res[0] is None else torch.cat(res))  # type: ignore[arg-type]


def local_scalers(u: UnitState, flat: torch.Tensor) -> torch.Tensor:
    """TernGrad: every shard's per-segment scalers (max-reduced over the ranks before encoding)."""
    return u.protocol.local_scalers(flat)


def exchange(t: TorchShardedTransport, u: UnitState, row: list[bytes]) -> tuple[list[bytes], list[list[int]]]:
    """The all-to-all of shard payloads: every rank's payload for this rank's shard, and the W×W
    table of sizes (``sizes[w][j]``: rank w's payload for shard j)."""
    served, sizes = t.exchange([row], u.protocol.caps(u.bits))
    return served[t.rank], sizes


def average(u: UnitState, payloads: list[bytes], rank: int) -> torch.Tensor:
    """Σ_w (1/W)·decode(payload_w) for this rank's shard, float32 (rank order)."""
    return u.protocol.reduce(rank, [bytes_tensor(p) for p in payloads], u.bits)


def settle(t: TorchShardedTransport, error: Exception | None, unit: int, step: int) -> int:
    """After the receive, make every rank stop together when any rank refused a payload it received
    (a corrupted body, a size or header that does not match): one all-reduce (MAX) of W status bytes
    (byte w: rank w refused) and, only then, one all-gather of the refusing ranks' error texts. Every
    rank raises the refusing rank's error type (PayloadError or ProtocolError) naming that rank, the
    unit, the step and the text, at once rather than at the timeout. Returns the bytes this rank
    handed to the group (the all-reduce's ring: 2·(W−1)/W of W bytes)."""
    flags = torch.zeros(t.workers, dtype=torch.uint8)
    flags[t.rank] = int(error is not None)
    refused = [w for w, f in enumerate(t.max_reduce([flags]).tolist()) if f]
    if not refused:
        return 2 * (t.workers - 1)
    mine = f"{type(error).__name__}: {error}".encode()[:REFUSAL_CAP] if error is not None else b""
    texts = [b.decode(errors="replace") for b in t.all_gather_bytes(mine, "refusal", REFUSAL_CAP)]
    kind, _, text = texts[refused[0]].partition(": ")
    also = f" (rank(s) {refused[1:]} refused payloads too)" if len(refused) > 1 else ""
    err = (ProtocolError if kind == "ProtocolError" else PayloadError)(f"rank {t.rank}: FSDP unit {unit}, compressed step {step}: rank "
                                                f"{refused[0]} refused a payload it received{also}: {text}")
    raise err from error


def spent_bits(u: UnitState, sizes: list[list[int]]) -> int:
    """The policy's spent bits of a step: the longest rank's uplink, all its shards together."""
    return u.protocol.spent_bits(sizes)


def observe(u: UnitState, group: dist.ProcessGroup, timeout: float | None, avg: torch.Tensor, rank: int,
            spent_bits: int) -> int:
    """Feed the unit's policy the statistics of the averaged gradient G = [G_0, …, G_{W−1}], of which
    this rank holds G_rank: one all-gather of every rank's partial statistics (and, for a policy that
    reads G itself, of its share of the policy's fixed-stride sample of G). Returns the bytes this
    rank handed to the group. ‖G‖_∞ = max_j ‖G_j‖_∞ exactly; ‖G‖₂² = Σ_j ‖G_j‖₂² (summed in rank order)."""
    m, world = u.method, u.world
    p = m.p
    a = avg.to(torch.float64)
    part = a.abs().amax() if math.isinf(p) else a.abs().pow(p).sum()
    mine = [part.reshape(1), a.square().sum().reshape(1)]
    stride, n = 0, avg.numel()
    if u.protocol.policy.needs_grad:
        stride = max(1, -(-u.numel // u.protocol.policy.sample))
        mine.append(_padded_sample(avg, rank * n, stride, _sample_len(n, stride)))
    vec = torch.cat(mine).to(torch.float32)
    rows = [torch.empty_like(vec) for _ in range(world)]
    wait(dist.all_gather(rows, vec, group=group, async_op=True), timeout, "policy statistics")
    parts = torch.stack(rows)
    norm = float(parts[:, 0].max()) if math.isinf(p) else float(parts[:, 0].sum() ** (1.0 / p))
    rms = math.sqrt(float(parts[:, 1].sum())) / math.sqrt(u.numel)
    grad = None
    if stride:
        pieces = [parts[w, STATS:STATS + _count(w * n, (w + 1) * n, stride)] for w in range(world)]
        grad = torch.cat(pieces).to(torch.float32)
    stats = GradStats(u.n, norm, rms, spent_bits, grad)
    u.policy = u.protocol.policy.update(u.policy, stats)
    return (world - 1) * vec.numel() * vec.element_size()


def _count(lo: int, hi: int, stride: int) -> int:
    """How many multiples of ``stride`` lie in [lo, hi)."""
    return -(-hi // stride) - -(-lo // stride)


def _sample_len(n: int, stride: int) -> int:
    return -(-n // stride) + 1  # the most multiples of stride any n consecutive integers hold


def _padded_sample(avg: torch.Tensor, lo: int, stride: int, length: int) -> torch.Tensor:
    """``G[i]`` for the global indices i ≡ 0 (mod stride) inside this shard, zero padded to ``length``."""
    first = -(-lo // stride) * stride - lo
    picked = avg[first::stride].to(torch.float64)
    return torch.cat([picked, torch.zeros(length - picked.numel(), dtype=torch.float64)])  # cast with the stats


def wait(work: dist.Work, timeout: float | None, what: str) -> None:
    """Wait for ``work`` at most ``timeout`` seconds; a failed or late collective raises
    :class:`~dqsgd.transport.torch_dist.TransportError` naming it."""
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError) as e:
        raise TransportError(f"FSDP reduce-scatter: {what} failed (a peer crashed, stopped or did not answer "
                             f"within the timeout): {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
