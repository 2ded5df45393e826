"""The entropy-coded downlink of the sharded step: its coding, its size cap, its encoder and decoder.

A shard server's downlink is a uniform max-norm payload at the step's width v (stochastic
rounding, or rounding to nearest under error feedback: :mod:`dqsgd.topology.bucket`). With
``downlink_coding`` other than ``"fixed"`` the same codes are carried by an entropy coding (the
codings of :class:`dqsgd.codecs.Coding`; ``"auto"`` sends the smallest of them and never more than
the fixed payload). Coding is lossless, so every rank decodes exactly the update a fixed downlink
gives: the model is bitwise the same, only the bytes differ.

What changes on the wire is the size. A coded payload's length depends on the codes, so the
shard servers' sizes are exchanged (one all-gather of W integers) before the payloads, which are
all-gathered padded to the longest, as the trainer's transports and the DDP hook both do; the
ledgers count those padded bytes. Under ``downlink_bits = "auto"`` the budget is charged the bytes
really received (:meth:`dqsgd.topology.bucket.BucketProtocol.spent_bits`), and the split policy
learns the coded / fixed ratio of the downlink from them (:mod:`dqsgd.policies.split`).

The default (``downlink_coding`` unset) is the uplink's coding for a quantized downlink: a method
that entropy-codes its uplink (``dqsgd-coded``: ``"auto"``) codes its downlink too; every other
method keeps the fixed downlink. An fp32 or sign (majority vote) downlink is always fixed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, get_args

import torch

from dqsgd.topology.names import FP32
from dqsgd.topology.registry import topology_of

if TYPE_CHECKING:
    from dqsgd.codecs import Coding
    from dqsgd.codecs.header import Header
    from dqsgd.kernels import HashRNG
    from dqsgd.method.pipeline import Method

__all__ = ["CODINGS", "FIXED", "Nearest", "decode_coded", "downlink_cap", "encode_coded", "resolve_downlink_coding"]

FIXED = "fixed"
SIGN_BITS = 1  # a majority vote's downlink: its signs


def _codings() -> tuple[str, ...]:
    from dqsgd.method.config import CodingName

    return get_args(CodingName)


CODINGS: tuple[str, ...] = _codings()


def resolve_downlink_coding(coding: object, *, uplink_coding: str, bits: int | str, vote: bool,
                            topology: str) -> str:
    """The coding a run's downlink uses: ``coding`` (a name of :data:`CODINGS`), or where it is None
    or ``""`` (not given) the uplink's coding for a quantized sharded downlink, else ``"fixed"``.
    A coding other than fixed where the downlink is not quantized (fp32, a vote's signs, no sharded
    downlink) is refused."""
    quantized = topology_of(topology).sharded and not vote and bits != FP32
    if coding is None or coding == "":
        return uplink_coding if quantized else FIXED
    if not isinstance(coding, str) or coding not in CODINGS:
        raise ValueError(f"downlink_coding must be one of {', '.join(CODINGS)} (or unset: the uplink's), "
                         f"got {coding!r}")
    if coding != FIXED and not quantized:
        what = ("a majority vote sends its signs" if vote else "an fp32 downlink" if bits == FP32
                else f"topology {topology!r} sends no quantized downlink")
        raise ValueError(f"downlink_coding = {coding!r}: {what}, which is sent fixed; it applies to topology "
                         f"'sharded' with downlink_bits 2..16 or 'auto'")
    return coding


def _coding(name: str) -> Coding:
    from dqsgd.codecs import Coding

    return Coding.from_name(name)


def downlink_cap(fixed_size: int, numel: int, dbits: int, coding: str) -> int:
    """The most bytes a valid downlink payload of one shard can take: the fixed size for ``"fixed"``
    and ``"auto"`` (which never sends more than fixed); for an explicit entropy coding the uplink's
    allowance (:meth:`dqsgd.method.pipeline.Method.max_payload_bytes`: 8 bytes per coordinate and a
    table beyond the fixed size)."""
    if coding in (FIXED, "auto"):
        return fixed_size
    return fixed_size + 8 * numel + 8 * (1 << min(dbits, 16)) + 4096


class Nearest:
    """A "uniform" source that is always 1/2: the uniform quantizer's ``low + (u < frac)`` becomes
    rounding to the nearest level (ties down), deterministic. The error-fed downlink rounds with it:
    |x_i − Q(x)_i| ≤ min(|x_i|, ‖x‖∞/(2s)), so the residual never holds more than x did, while
    stochastic rounding's E‖x − Q(x)‖² ≈ ‖x‖∞·‖x‖₁ at s = 1 can exceed ‖x‖² and feed itself."""

    def uniform(self, n: int, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.full((n,), 0.5, dtype=torch.float32, device=device)


def encode_coded(m: Method, x: torch.Tensor, dbits: int, coding: str, rng: HashRNG | None) -> torch.Tensor:
    """Shard ``x`` rounded at ``dbits`` with the max norm and ``m``'s layout — stochastically with
    ``rng``'s uniforms (the codes the fixed downlink sends), or to the nearest level where ``rng``
    is None (error feedback, :class:`Nearest`) — as a ``coding`` payload on ``x``'s device (encoded
    on the host). With ``"fixed"`` and ``rng`` None: the fixed payload of the rounded codes, which
    the fixed decoder reads unchanged. Coding ``"auto"`` with the method's ``link_mbit``: the coding
    whose modelled encode + decode + link time is least, as the uplink's (never longer than fixed)."""
    from dqsgd.codecs import encode
    from dqsgd.kernels import encode_uniform_fast, quantize_uniform_fast
    from dqsgd.quantizers import Norm, quantize_uniform
    from dqsgd.topology.payloads import bytes_tensor, downlink_size

    host = x.detach().reshape(-1).cpu()
    link = m.config.link_mbit if coding == "auto" else 0.0
    if rng is None or link:
        q = (quantize_uniform(host, dbits, norm=Norm.MAX, layout=m.layout, rng=Nearest()) if rng is None
             else quantize_uniform_fast(host, dbits, rng, norm=Norm.MAX, layout=m.layout))
        payload = encode(q, _coding(coding), link_mbit=link)
        if link and len(payload) > downlink_cap(downlink_size(m, dbits), m.numel, dbits, coding):
            payload = encode(q, _coding(FIXED))  # the fastest by its time model, but longer than fixed: fixed
    else:
        payload = encode_uniform_fast(host, dbits, rng, norm=Norm.MAX, layout=m.layout, coding=_coding(coding))
    return bytes_tensor(payload, x.device)



def decode_coded(p: torch.Tensor, out: torch.Tensor, dbits: int, m: Method,
                 refuse: Callable[[str], Exception]) -> Header:
    """``out += `` the coded downlink payload ``p`` (exactly its bytes) of a shard of ``m``, decoded
    on the host and validated as the fixed downlink's (uniform, max norm, width ``dbits``, ``m``'s
    layout, the shard's length); ``refuse(text)`` makes the error raised on a mismatch."""
    from dqsgd.kernels import decode_accumulate, read_header
    from dqsgd.quantizers import Norm, Scheme

    arr = p.cpu().numpy()
    h = read_header(arr, max_numel=max(out.numel(), 1))
    if (h.scheme, h.bits, h.norm) != (Scheme.UNIFORM, dbits, Norm.MAX) or h.numel != out.numel() \
            or h.layout != m.layout:
        raise refuse(f"a coded downlink payload of scheme {h.scheme.name}, {h.bits} bits, norm {h.norm.name}, "
                     f"{h.numel} values; expected uniform, {dbits} bits, max norm, {out.numel()} values and the "
                     f"shard's layout")
    if out.device.type == "cpu" and out.is_contiguous():
        return decode_accumulate(arr, out, header=h)
    tmp = torch.zeros(out.numel(), dtype=torch.float32)
    decode_accumulate(arr, tmp, header=h)
    out += tmp.to(out.device)
    return h
