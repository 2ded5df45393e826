"""Payloads as ``uint8`` tensors on a bucket's device: encoding, decoding and the bytes<->tensor conversion.

The one codec path of :class:`dqsgd.topology.bucket.BucketProtocol` (the trainer, the transports and
the DDP hook alike).

Two functions choose where the codec runs (:func:`encode_uniform_payload`,
:func:`decode_accumulate_payload`): on CPU the fused numba kernels of :mod:`dqsgd.kernels`; on any
other device the torch-ops device codec ``dqsgd.kernels.device`` (imported only for non-CPU
tensors), which writes the same wire bytes for the same ``HashRNG``. Every other scheme (sign,
ternary, identity), error feedback and the entropy codings go through the host path
(:meth:`dqsgd.method.pipeline.Method.encode`): the bucket is copied to the CPU, encoded there, and the
payload copied back.

A *message* is a payload followed by one flag byte (:data:`FLAG_NONFINITE`, :data:`FLAG_ZERO`), so
the non-finite signal of AMP overflow and signSGD's "this rank abstains" travel inside the
collective that carries the gradient: no extra collective, no host synchronization.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

if TYPE_CHECKING:  # the codec modules load numba: imported on first use only
    from dqsgd.codecs.header import Header
    from dqsgd.kernels import HashRNG
    from dqsgd.kernels.codec import FixedPlan
    from dqsgd.method.pipeline import Method
    from dqsgd.quantizers import Layout, Norm

__all__ = ["FLAG_NONFINITE", "FLAG_ZERO", "FP32", "SIGN", "accumulate", "accumulate_batch", "batched", "bytes_tensor",
           "decode_accumulate_payload", "device_path", "downlink_size", "encode_batched", "encode_downlink",
           "encode_downlink_padded", "encode_messages", "encode_shard", "encode_uniform_payload", "fast_path",
           "messages", "packed", "pad", "route_cpu_through_device_codec", "set_flags", "tensor_bytes", "vote"]

FLAG_NONFINITE = 1  # this rank's bucket had NaN or Inf (AMP overflow): every rank returns NaN
FLAG_ZERO = 2       # this rank's bucket is all zeros: it abstains from a majority vote
FP32 = 32           # downlink width meaning "no quantization" (identity payloads)
SIGN = 1            # downlink width of a majority vote: its signs, one bit each

_DEVICE_CODEC_ON_CPU = False


def route_cpu_through_device_codec(on: bool) -> None:
    """Send CPU buckets through the torch-ops device codec (the GPU code path) instead of the numba
    kernels. The payloads are byte-identical either way; this exists so that the GPU code path of
    the hook runs, and is tested, on machines without a GPU."""
    global _DEVICE_CODEC_ON_CPU
    _DEVICE_CODEC_ON_CPU = bool(on)


def device_path(t: torch.Tensor) -> bool:
    """Whether ``t``'s payloads go through the torch-ops device codec (non-CPU tensors, or forced)."""
    return t.device.type != "cpu" or _DEVICE_CODEC_ON_CPU


def bytes_tensor(payload: bytes, device: torch.device | str = "cpu", length: int | None = None) -> torch.Tensor:
    """``payload`` as a ``uint8`` tensor on ``device``: read-only and without a copy on CPU, or a new
    tensor zero-padded to ``length`` bytes."""
    device = torch.device(device)
    if length is not None:
        buf = torch.zeros(length, dtype=torch.uint8)
        if payload:
            buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return buf.to(device)
    with warnings.catch_warnings():  # torch warns that bytes are not writable; nobody writes to it
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    return t if device.type == "cpu" else t.to(device)


def tensor_bytes(t: torch.Tensor, length: int | None = None) -> bytes:
    """The first ``length`` bytes (all by default) of a ``uint8`` tensor, as ``bytes``."""
    return (t if length is None else t[:length]).cpu().numpy().tobytes()


def encode_uniform_payload(x: torch.Tensor, bits: int, rng: HashRNG, *, norm: Norm, layout: Layout) -> torch.Tensor:
    """The FIXED payload of the hash-RNG stochastic uniform quantizer of ``x``, on ``x.device``.

    CPU: :func:`dqsgd.kernels.encode_uniform_fast`; elsewhere the device codec, byte-identical.
    """
    if device_path(x):
        from dqsgd.kernels.device import encode_uniform_device

        # No sync: the hook zeroes non-finite entries before encoding; a norm too small for
        # float32 writes a NaN scale, which the receiving rank's decoder flags.
        return encode_uniform_device(x, bits, rng, norm=norm, layout=layout, check="defer")
    from dqsgd.kernels import encode_uniform_fast

    return bytes_tensor(encode_uniform_fast(x, bits, rng, norm=norm, layout=layout), x.device)


def decode_accumulate_payload(payload: torch.Tensor, out: torch.Tensor, weight: float = 1.0, *,
                              max_numel: int, expect: tuple[int, Norm, Layout] | None = None,
                              bad: torch.Tensor | None = None, check: Callable[[Header], None] | None = None) -> Header:
    """``out += weight · x̂`` for a payload tensor, on ``out``'s device, validating like ``decode``.

    Device path: ``expect = (bits, norm, layout)`` of a uniform FIXED payload lets the decoder
    compare the header on the device instead of reading it to the host; with ``bad`` (a 0-dim bool
    tensor) the crc, padding and code-range checks are ORed into it instead of raising, so nothing
    waits for the device (the hook reads ``bad`` a step later, see ``BucketState.check_payloads``).

    CPU: with ``expect``, a payload whose header bytes are the expected ones is decoded by its
    :class:`FixedPlan` without parsing the header (crc, scales, padding and codes still checked);
    any other payload is parsed, and refused as ``decode`` refuses it; ``check(header)`` (if given)
    runs on a parsed header before anything is added to ``out``.
    """
    if device_path(out):
        from dqsgd.kernels.device import decode_accumulate_device, expected_header

        header = None if expect is None else expected_header((out.numel(),), expect[0], norm=expect[1],
                                                             layout=expect[2])
        check = "sync" if bad is None or header is None else "defer"
        return decode_accumulate_device(payload, out, weight, max_numel=max_numel, header=header, check=check,
                                        bad=bad if check == "defer" else None)
    from dqsgd.kernels import decode_accumulate, read_header

    arr = payload.numpy()
    plan = None if expect is None else _cpu_plan(out.numel(), *expect, out)
    if plan is not None and plan.matches(arr):
        return plan.accumulate(arr, out, weight)
    h = read_header(arr, max_numel=max_numel)
    if check is not None:
        check(h)
    return decode_accumulate(arr, out, weight, header=h)


def fast_path(m: Method) -> bool:
    """Uniform with hash uniforms, FIXED, no error feedback: the payload size follows from (numel, bits)."""
    from dqsgd.codecs import Coding

    return m.fused and m.config.scheme == "uniform" and m.coding == Coding.FIXED and not m.config.error_feedback


def encode_shard(m: Method, x: torch.Tensor, bits: int, rng: HashRNG, generator: torch.Generator | None,
                 residual: torch.Tensor | None, scalers: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
    """One shard's uplink payload (a ``uint8`` tensor on ``x.device``) and its new residual."""
    if fast_path(m):
        return encode_uniform_payload(x, bits, rng, norm=m.norm, layout=m.layout), None
    payload, res = m.encode(x.cpu(), bits, generator, residual, scalers, hash_rng=rng if m.fused else None)
    return bytes_tensor(payload, x.device), res


def accumulate(m: Method, payloads: list[torch.Tensor], bits: int, out: torch.Tensor,
               bad: torch.Tensor | None = None, *, weight: float = 1.0, fresh: bool = False) -> None:
    """``out += Σ_w weight·x̂_w`` in rank order, each payload scaled before it is added (a mean of
    finite values stays finite); ``bad``: deferred validation on the device path
    (:func:`decode_accumulate_payload`). Uniform FIXED payloads are added in one batched call
    (:func:`accumulate_batch`), the others one by one. ``fresh``: ``out``'s contents are not used
    (written as if it held zeros)."""
    expect = (bits, m.norm, m.layout) if fast_path(m) else None
    if expect is None or not accumulate_batch([(m.numel, m.layout)] * len(payloads), bits, m.norm, payloads, out,
                                              [0] * len(payloads), weight, bad,
                                              lambda o: _accumulate_each(m, payloads, bits, o, None, weight, expect),
                                              fresh=fresh):
        if fresh:
            out.zero_()
        _accumulate_each(m, payloads, bits, out, bad, weight, expect)


def _accumulate_each(m: Method, payloads: list[torch.Tensor], bits: int, out: torch.Tensor, bad: torch.Tensor | None,
                     weight: float, expect: tuple[int, Norm, Layout] | None) -> None:
    from dqsgd.codecs import PayloadError

    for w, p in enumerate(payloads):
        def check(h: Header, w: int = w) -> None:
            m.check_uplink(h.scheme, h.numel, h.bits, bits, w)

        try:
            h = decode_accumulate_payload(p, out, weight, max_numel=max(m.numel, 1), expect=expect, bad=bad,
                                          check=check)
        except PayloadError as e:
            raise PayloadError(f"worker {w}: {e}") from None
        check(h)


def batched(t: torch.Tensor) -> bool | None:
    """How the batched codec (:mod:`dqsgd.kernels.batch`) runs on ``t``'s codec: False: the numba
    kernels (CPU), True: the Triton kernels, None: not batched (the torch-ops device codec codes one
    payload per call)."""
    if not device_path(t):
        return False
    from dqsgd.kernels.device_common import use_triton

    return True if use_triton(t.device) else None


def packed(payloads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One ``uint8`` buffer holding every payload and each one's offset in it: without a copy where
    they are views of one contiguous buffer (a collective's receive buffer), else concatenated."""
    st = payloads[0].untyped_storage()
    if all(p.dtype == torch.uint8 and p.dim() == 1 and p.stride(0) == 1
           and p.untyped_storage().data_ptr() == st.data_ptr() for p in payloads):
        base = payloads[0].as_strided((st.nbytes(),), (1,), 0)  # a view of the whole storage: no allocation
        return base, [p.storage_offset() for p in payloads]
    at = [0]
    for p in payloads[:-1]:
        at.append(at[-1] + p.numel())
    return torch.cat(list(payloads)), at


def accumulate_batch(spec: Sequence[tuple[int, Layout]], bits: int, norm: Norm, payloads: Sequence[torch.Tensor],
                     out: torch.Tensor, out_at: Sequence[int], weight: float, bad: torch.Tensor | None,
                     refuse: Callable[[torch.Tensor], None], padded: bool = False, fresh: bool = False) -> bool:
    """``out[out_at[p] :][: numel_p] += weight·x̂_p`` for the uniform FIXED payloads ``payloads``
    (``spec[p]`` = (numel, layout); ``padded``: a payload may be followed by more bytes, which are
    not read) in one batched call; False where the batch does not apply (then
    nothing was added). The Triton batch defers its checks: it applies only with ``bad``. A payload
    the CPU batch finds wrong is refused by ``refuse(scratch)``, the one-by-one decoder that says
    why, run on a zeroed copy of ``out`` (``out`` is then to be discarded). ``fresh``: ``out``'s
    contents are not used: the sums are written as if it held zeros (the same bits; the Triton batch
    does not read it, the CPU batch zeroes it first; every coordinate of ``out`` must be some payload's);
    where the batch does not apply it is untouched."""
    tri = batched(out)
    if tri is None or (tri and bad is None) or not payloads:
        return False
    from dqsgd.kernels.batch import decode_batch
    from dqsgd.kernels.codec import fixed_plan

    sizes = [fixed_plan(n, bits, norm, lay).size for n, lay in spec]
    if any(p.numel() != n and not (padded and p.numel() > n) for p, n in zip(payloads, sizes)):
        return False
    buf, at = packed(payloads)
    b = decode_batch(tuple(spec), bits, norm, tuple(at), tuple(out_at))
    if tri:  # the Triton batch: its checks set ``bad``, no sync
        from dqsgd.kernels.triton_batch import accumulate_batch_triton

        accumulate_batch_triton(b, buf, out, weight, bad, fresh)
        return True
    if fresh:
        out.zero_()
    if b.accumulate(buf, out, weight) is not None:
        refuse(torch.zeros_like(out))
        raise RuntimeError("the batched decoder refused a payload that the one-by-one decoder accepts")
    return True


def _cpu_plan(numel: int, bits: int, norm: Norm, layout: Layout, t: torch.Tensor) -> FixedPlan | None:
    """The :class:`FixedPlan` of a uniform FIXED payload when ``t``'s codec is the numba one
    (a CPU tensor, not routed through the device codec), else None."""
    if device_path(t):
        return None
    from dqsgd.kernels.codec import fixed_plan

    return fixed_plan(numel, bits, norm, layout)


def encode_batched(shards: list[Method], bounds: list[tuple[int, int]], flat: torch.Tensor, bits: int,
                   rngs: list[HashRNG], gap: int = 0) -> tuple[torch.Tensor, list[int], list[int]] | None:
    """Every shard's uplink payload in one batched call (:mod:`dqsgd.kernels.batch`): one ``uint8``
    buffer on ``flat``'s device, payload j at ``offsets[j]`` (``sizes[j]`` bytes) and ``gap`` zero
    bytes after each; returned with the offsets and the sizes. The payloads of :func:`encode_shard`,
    byte for byte. None where the batch does not apply (not :func:`fast_path`, or the torch-ops
    device codec).

    Raises:
      NonFiniteGradientError: ``flat`` has NaN or Inf (CPU; its ``shard`` attribute names the shard).
    """
    tri = batched(flat)
    if (tri is None or (not tri and flat.dtype != torch.float32) or not all(fast_path(m) for m in shards)
            or len({m.norm for m in shards}) != 1):
        return None
    from dqsgd.kernels.batch import encode_batch

    if [lo for lo, _ in bounds] != [0] + [hi for _, hi in bounds[:-1]]:
        raise ValueError(f"shard bounds {bounds} are not the contiguous pieces of one vector")
    b = encode_batch(tuple((hi - lo, m.layout) for m, (lo, hi) in zip(shards, bounds)), bits, shards[0].norm, gap)
    keys = [r.key for r in rngs]
    if tri:
        from dqsgd.kernels.triton_batch import encode_batch_triton

        return encode_batch_triton(b, flat, keys), list(b.offsets), b.sizes
    return b.encode(flat, keys), list(b.offsets), b.sizes


def encode_messages(shards: list[Method], bounds: list[tuple[int, int]], flat: torch.Tensor, bits: int,
                    rngs: list[HashRNG]) -> tuple[torch.Tensor, list[int]] | None:
    """Every shard's payload followed by one (zero) flag byte in one ``uint8`` tensor (the
    collective's send buffer): the bytes of :func:`messages` of the :func:`encode_shard` payloads,
    written by one batched call (:func:`encode_batched`); returned with the payloads' sizes. None
    where that path does not apply.

    Raises:
      NonFiniteGradientError: ``flat`` has NaN or Inf (CPU).
    """
    got = encode_batched(shards, bounds, flat, bits, rngs, gap=1)
    return None if got is None else (got[0], got[2])


def messages(payloads: list[torch.Tensor], flags: torch.Tensor) -> torch.Tensor:
    """``payload_0, flag, payload_1, flag, …`` in one ``uint8`` tensor."""
    return torch.cat([t for p in payloads for t in (p, flags.reshape(1))])


def set_flags(send: torch.Tensor, sizes: list[int], flag: int) -> list[torch.Tensor]:
    """Write ``flag`` after each payload of a CPU :func:`messages` buffer whose payloads have
    ``sizes`` bytes; returns the payloads (views)."""
    buf, at, out = send.numpy(), 0, []
    for n in sizes:
        out.append(send[at : at + n])
        buf[at + n] = flag
        at += n + 1
    return out


def vote(m: Method, payloads: list[torch.Tensor], bits: int, voters: list[bool] | None = None) -> torch.Tensor:
    """signSGD's majority vote of the sign payloads (:func:`dqsgd.quantizers.majority_vote`: ties → +1,
    ``voters[w]`` False: rank w abstains, no voter → 0), as float32; every payload is validated."""
    from dqsgd.quantizers import majority_vote

    codes = [m.decode_uplink(tensor_bytes(p), bits, w).codes for w, p in enumerate(payloads)]
    return majority_vote(codes, voters).to(torch.float32)


def downlink_size(m: Method, dbits: int) -> int:
    """Exact length of a shard's downlink payload at ``dbits`` (:data:`FP32`: identity; :data:`SIGN`:
    the vote's signs, one segment)."""
    from dqsgd.codecs import Coding, predicted_size
    from dqsgd.quantizers import Layout

    if dbits == FP32:
        return predicted_size(m.numel, 32, 0, 1, Layout(), Coding.FIXED)
    if dbits == SIGN:
        return predicted_size(m.numel, 1, 1, 1, Layout(), Coding.FIXED)
    return m.message_bits(dbits) // 8


def encode_downlink_padded(m: Method, avg: torch.Tensor, dbits: int, rng: HashRNG,
                           size: int) -> tuple[torch.Tensor, int]:
    """:func:`encode_downlink`'s payload followed by zeros up to ``size`` bytes, and its length: on
    the CPU codec written in place into the all-gather's buffer (same bytes)."""
    from dqsgd.quantizers import Norm

    plan = None if dbits in (FP32, SIGN) else _cpu_plan(m.numel, dbits, Norm.MAX, m.layout, avg)
    if plan is None or plan.size > size:
        pay = encode_downlink(m, avg, dbits, rng)
        return pad(pay, max(size, pay.numel())), pay.numel()
    msg = torch.empty(size, dtype=torch.uint8)
    buf = msg.numpy()
    plan.encode_into(avg, rng, buf[: plan.size])
    buf[plan.size :] = 0
    return msg, plan.size


def encode_downlink(m: Method, avg: torch.Tensor, dbits: int, rng: HashRNG) -> torch.Tensor:
    """The averaged shard quantized for the downlink: max-norm stochastic rounding at ``dbits``, its
    signs (:data:`SIGN`, a majority vote) or fp32 (:data:`FP32`)."""
    from dqsgd.quantizers import Norm

    if dbits in (FP32, SIGN):
        from dqsgd.codecs import Coding, encode
        from dqsgd.quantizers import quantize_identity, quantize_sign

        q = quantize_identity(avg.cpu()) if dbits == FP32 else quantize_sign(avg.cpu())
        return bytes_tensor(encode(q, Coding.FIXED), avg.device)
    return encode_uniform_payload(avg, dbits, rng, norm=Norm.MAX, layout=m.layout)


def pad(payload: torch.Tensor, size: int) -> torch.Tensor:
    """``payload`` followed by zeros up to ``size`` bytes (all-gathers need equal sizes)."""
    if size == payload.numel():
        return payload
    return torch.cat([payload, torch.zeros(size - payload.numel(), dtype=torch.uint8, device=payload.device)])
