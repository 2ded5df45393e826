"""The quantized parameter all-gather of FSDP2 (``FSDPModule.set_custom_all_gather``): Double
Quantization's model quantizer on the leg that carries the weights to every rank.

FSDP (torch 2.13, ``_fsdp_collectives.foreach_all_gather``) copies a unit's parameter shards —
in ``MixedPrecisionPolicy.param_dtype`` when one is set — into this rank's chunk of one flat
output of W·n elements, calls ``comm(output_tensor=out, input_tensor=chunk, group=shard_group,
async_op=...)`` (``chunk`` is a view of ``out``) and, after the returned work, copies ``out`` into
the unsharded parameters that the forward and backward compute with. The sharded parameters the
optimizer updates are not touched.

Here every rank quantizes its chunk block-wise (``param_block`` coordinates per max-norm scale,
``param_bits`` bits: s = 2^(b−1) − 1 levels, FIXED coding of the project's wire format) and the
ranks all-gather the payloads in one collective: each sends a frame of the size every rank computes
(:func:`frame`: a header with the payload's length and status, then the payload padded to the bound
of a payload of n elements, which a fixed-coded payload fills exactly). Every rank checks the W
frames and decodes the W payloads into a buffer of its own (:func:`opened`); as all ranks hold the
same bytes and run the same checks, a refusal raises the same error on every rank without any
verdict being exchanged. Only then is the buffer copied into ``out``: the W dequantized chunks —
its own too, so all ranks compute with the same weights.
``param_bits = 32`` sends the float32 values (lossless).

The codec runs in compiled loops: the encode is one pass for the block norms and one that rounds
and packs (:mod:`dqsgd.kernels.rounding`: the bytes of ``encode(quantize_uniform(...), FIXED)``),
the decode one pass that checks and dequantizes
(:meth:`~dqsgd.kernels.codec.FixedPlan.accumulate`), each a few times a ``copy_`` of the shard
(``benchmarks/fsdp_gather_cost.py``; they were 40 to 150 times one in torch ops).

Per coordinate x_i of a block with r = max|x|: round-to-nearest gives |Q(x)_i − x_i| ≤ r/(2s),
stochastic rounding |Q(x)_i − x_i| < r/s with E[Q(x)_i] = x_i (float32 arithmetic adds at most a
few units of r·2^-24). The optimizer's full-precision shard is quantized afresh every gather, so
the error never enters the weights.
"""

from __future__ import annotations

import struct
import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from dqsgd.core.rng import QUANT, seed_for
from dqsgd.fsdp.net import Done, exchange_group
from dqsgd.topology.group import DOWN

if TYPE_CHECKING:
    from dqsgd.fsdp.state import FSDPState

PARAM_STREAM = 0x5041  # the parameter leg's randomness, apart from the gradient keys of the same unit
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEADER = struct.Struct("<QB7x")  # a frame's payload length and status, 16 bytes
FINE, NONFINITE = 0, 1  # the statuses: a payload; the shard holds NaN or Inf (no payload)


def _all_gather_base() -> type:
    try:  # the interface class lives in a private torch module; compress() reports its absence
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
    except ImportError:
        return object
    return AllGather


def param_bound(scale: torch.Tensor | float, bits: int, rounding: str) -> torch.Tensor | float:
    """The most |Q(x)_i − x_i| of a block of max-norm ``scale`` in exact arithmetic: r/(2s) for
    round-to-nearest, r/s for stochastic rounding (0 for 32 bits)."""
    if bits == 32:
        return scale * 0.0
    from dqsgd.quantizers import levels_for_bits

    s = levels_for_bits(bits)
    return scale / (2 * s) if rounding == "nearest" else scale / s


def encode_shard(x: torch.Tensor, bits: int, rounding: str, block: int, seed: int) -> bytes:
    """One rank's payload of its parameter chunk ``x`` (float32), or ``b""`` when ``x`` holds NaN or
    Inf. Quantized widths go through the fused kernel of :mod:`dqsgd.kernels.rounding`: the bytes of
    ``encode(quantize_uniform(x, bits, …, layout=Layout(bucket=block)), FIXED)`` with round-to-nearest
    or the ``torch.rand`` uniforms of a generator seeded with ``seed``."""
    from dqsgd.quantizers import Layout, NonFiniteGradientError

    if bits == 32:
        from dqsgd.codecs import Coding, encode
        from dqsgd.quantizers import quantize_identity

        return encode(quantize_identity(x), Coding.FIXED) if bool(torch.isfinite(x).all()) else b""
    from dqsgd.kernels.rounding import NEAREST, encode_rounded

    g = torch.Generator().manual_seed(seed)
    u = NEAREST if rounding == "nearest" else torch.rand(x.numel(), generator=g).numpy()
    try:
        return encode_rounded(x, bits, Layout(bucket=block), u)
    except NonFiniteGradientError:
        return b""


def payload_cap(numel: int, bits: int, block: int) -> int:
    """The most bytes a payload of ``numel`` parameters can take (sizes above it are refused)."""
    from dqsgd.codecs import Coding
    from dqsgd.codecs.bounds import max_payload_bytes
    from dqsgd.quantizers import Layout

    return max_payload_bytes(numel, bits, layout=Layout(bucket=block if bits != 32 else 0), coding=Coding.FIXED)


def decode_shard(payload: bytes, numel: int, bits: int, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dequantized chunk of one rank, written into ``out`` (a zeroed float32 CPU tensor of
    ``numel``) or a new tensor; PayloadError for anything that is not a finite payload of ``numel``
    parameters at this width and block (``out`` may then hold part of it: the all-gather decodes into
    a buffer of its own, and writes FSDP's output only once every rank's payloads have passed).

    A payload with the header an honest rank writes (:meth:`~dqsgd.kernels.codec.FixedPlan.matches`)
    is checked and decoded in one compiled pass (:meth:`~dqsgd.kernels.codec.FixedPlan.accumulate`:
    crc, scales, padding, code range, finite values, with the bytes of ``dequantize(decode(payload))``);
    any other (32 bits, or a header that differs) through :func:`dqsgd.codecs.decode`, which says
    what is wrong with it."""
    import numpy as np

    from dqsgd.codecs import PayloadError, decode
    from dqsgd.kernels.codec import fixed_plan
    from dqsgd.quantizers import Layout, Norm, Scheme, dequantize

    v = torch.zeros(numel) if out is None else out
    if bits != 32:
        plan = fixed_plan(numel, bits, Norm.MAX, Layout(bucket=block))
        arr = np.frombuffer(payload, dtype=np.uint8)
        if plan.matches(arr):
            plan.accumulate(arr, v)
            return v
    q = decode(payload, max_numel=numel)
    scheme, layout = (Scheme.IDENTITY, Layout()) if bits == 32 else (Scheme.UNIFORM, Layout(bucket=block))
    if q.numel != numel or q.scheme != scheme or (bits != 32 and (q.bits != bits or q.layout != layout)):
        raise PayloadError(f"parameter payload: {q.scheme.name} of {q.numel} elements at {q.bits} bits, "
                           f"expected {scheme.name} of {numel} at {bits} bits, blocks of {block}")
    d = dequantize(q).reshape(-1).to(torch.float32)
    if not bool(torch.isfinite(d).all()):
        raise PayloadError("parameter payload decodes to NaN or Inf")
    return v.copy_(d)


class DQSGDAllGather(_all_gather_base()):  # type: ignore[misc]
    """FSDP2's parameter all-gather for one unit, quantized (see the module docstring). Synchronous:
    the output holds every rank's dequantized chunk when the call returns."""

    def __init__(self, state: FSDPState, unit: int):
        self.state, self.index = state, unit

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @property
    def calls(self) -> int:
        """This unit's parameter all-gathers so far (kept in the state, so ``state_dict`` carries it and a
        resumed run draws the same stochastic roundings)."""
        return self.state.gather_calls.get(self.index, 0)

    def seed(self, rank: int, call: int) -> int:
        """The stochastic rounding's seed of this unit, rank and call (the same on a rerun)."""
        return seed_for(self.state.seed, QUANT, PARAM_STREAM, self.index, rank, call)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        t0 = time.perf_counter()
        st = self.state
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        n = input_tensor.numel()
        if input_tensor.dtype not in _DTYPES or output_tensor.dtype != input_tensor.dtype:
            raise TypeError(f"dqsgd's FSDP all-gather moves float32, bfloat16 or float16 parameters "
                            f"(MixedPrecisionPolicy.param_dtype); got input {input_tensor.dtype}, output "
                            f"{output_tensor.dtype}")
        if output_tensor.numel() != world * n:
            raise ValueError(f"all-gather output of {output_tensor.numel()} elements for an input of {n} over "
                             f"{world} ranks (need output = W · input)")
        bits, block = int(st.param_bits), st.param_block  # type: ignore[arg-type]
        x = input_tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        cap = payload_cap(n, bits, block)
        mine = frame(encode_shard(x, bits, st.param_rounding, block, self.seed(rank, self.calls)), cap)
        g = exchange_group(group, st.timeout)
        frames = g.wait(g.all_gather(mine, DOWN))  # the one collective: every rank gets the same W frames
        chunks = torch.zeros(world, n)  # FSDP's output is written once every payload passed
        opened(frames, cap, f"rank {rank}: FSDP unit {self.index} parameter all-gather", self.calls,
               lambda w, p: decode_shard(p, n, bits, block, chunks[w]))
        output_tensor.view(world, n).copy_(chunks)
        st.count_params((world - 1) * cap, (world - 1) * HEADER.size, (world - 1) * 4 * n)
        st.gather_calls[self.index] = self.calls + 1
        st.seconds += time.perf_counter() - t0
        return Done() if async_op else None


def frame(payload: bytes, cap: int) -> torch.Tensor:
    """One rank's message of the all-gather: a header (the payload's length and a status: 0, a payload;
    1, the shard holds NaN or Inf and ``payload`` is empty), then the payload zero-padded to ``cap``
    bytes — every rank's message has the size ``HEADER.size + cap`` that every rank computes, so no
    sizes travel. A payload longer than ``cap`` (which no honest encode writes) keeps its length in the
    header and is cut: every rank then refuses it by that length."""
    out = torch.zeros(HEADER.size + cap, dtype=torch.uint8)
    out[: HEADER.size] = torch.frombuffer(bytearray(HEADER.pack(len(payload), FINE if payload else NONFINITE)),
                                          dtype=torch.uint8)
    body = payload[:cap]
    if body:
        out[HEADER.size: HEADER.size + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return out


def opened(frames: Sequence[torch.Tensor], cap: int, what: str, call: int,
           decode: Callable[[int, bytes], object]) -> None:
    """Check the W gathered frames in rank order and ``decode(w, payload)`` each. Every rank holds the
    same bytes and runs the same checks, so every rank raises the same error, naming the sender: a
    status that is neither 0 nor 1 or a length above ``cap`` (PayloadError), shards holding NaN or Inf
    (ValueError, naming them all), or a payload that ``decode`` refuses (its PayloadError)."""
    from dqsgd.codecs import PayloadError
    from dqsgd.topology.refusal import check_sizes

    heads = [HEADER.unpack(bytes(f[: HEADER.size].numpy())) for f in frames]
    for w, (length, status) in enumerate(heads):
        if status not in (FINE, NONFINITE):
            raise PayloadError(f"{what}: rank {w} sent a frame of status {status} (0: a payload, 1: a shard "
                               "holding NaN or Inf): refused")
        check_sizes([length], [cap], f"{what}: rank {w}")
    empty = [w for w, (_, status) in enumerate(heads) if status == NONFINITE]
    if empty:
        raise ValueError(f"{what} {call}: the parameter shard of rank(s) {empty} holds NaN or Inf; nothing was "
                         "gathered")
    for w, (f, (length, _)) in enumerate(zip(frames, heads)):
        try:
            decode(w, f[HEADER.size: HEADER.size + length].numpy().tobytes())
        except PayloadError as e:
            raise PayloadError(f"{what} {call}: every rank refuses the payload of rank {w}: {e}") from e
