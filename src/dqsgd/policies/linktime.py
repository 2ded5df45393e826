"""A time model of one step and the widths that reach the full-precision accuracy soonest [OC].

The objective (docs/algorithms.md §11.5b): a step that sends uplink width B_u and downlink width B_d
with coding c costs ρ(B_u, B_d) more steps than full precision to reach the same accuracy, and each
step takes T(B_u, B_d, c) seconds, so the predicted time to the full-precision run's accuracy is,
up to the constant N_0 (the full-precision run's steps),

    J(B_u, B_d, c) = ρ(B_u, B_d) · T(B_u, B_d, c)
    ρ = 1 + (q(B_u)/W + q(B_d)) / σ²,           q(B) = d·‖g‖_p² / (6·s_B²),  s_B = 2^(B−1) − 1
    T = t_compute + d·(κ(B_u, c) + κ(B_d, c) + σ)·1e−9 + 2·m·latency + 8·m·(bytes_u + bytes_d)/rate

with κ(B, c) the codec's encode + decode nanoseconds per coordinate, m the messages that cross the
bottleneck link per direction, bytes = header + d·β(B, c)/8 (β: wire bits per coordinate). Sending
the bucket in its dtype ("uncompressed", width 0 here) has ρ = 1, κ = 0 and β = 8·dtype bytes.
σ is what a step costs per coordinate beyond those terms, by kind: ``step_ns[c]`` for a compressed step
of coding c (quantizing, the policy's figures, the exchange's extra collectives and waits, what the
coding's model misses), ``plain_ns`` for the
uncompressed all-reduce; 0 unless measured (:func:`calibrated`: a timed step of each kind).

Every figure is *stated* (a :class:`TimeModel` value): the simulation builds it from the config only;
a distributed caller that measures the link or the codec must agree on one model on every rank
before deciding (:func:`agree`: the elementwise maximum of the ranks' figures), so that every rank
and the simulation take the same decision from the same numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dqsgd.quantizers.constants import levels_for_bits

__all__ = ["UNCOMPRESSED", "UNCOMPRESSED_DTYPES", "Choice", "LinkEstimate", "TimeModel", "agree", "calibrated",
           "check_uncompressed_dtype",
           "choose", "codec_slowdown", "measure_link", "objective", "on_measured", "time_codec"]

UNCOMPRESSED = 0  # the width that stands for "the bucket in its dtype"


@dataclass(frozen=True)
class Choice:
    up: int         # uplink width (UNCOMPRESSED: the dtype)
    down: int       # downlink width (UNCOMPRESSED: the dtype)
    coding: str     # a key of TimeModel.codec_ns ("" when both directions are uncompressed)


@dataclass(frozen=True)
class TimeModel:
    """Seconds per step as a function of the widths and the coding: all figures stated.

    ``mbit``: the link's throughput (Mbit/s); ``latency_s``: per message; ``compute_s``: forward and
    backward per step; ``codec_ns[coding]``: encode + decode ns per coordinate at each width
    (a tuple indexed by width − 1); ``wire_bits[coding]``: bits per coordinate on the wire at each
    width (FIXED: the width itself; a coded row: the measured or predicted entropy); ``messages``:
    messages per direction over the bottleneck link; ``header_bits``: per message.
    """

    mbit: float
    latency_s: float = 0.0
    compute_s: float = 0.0
    codec_ns: Mapping[str, Sequence[float]] = field(default_factory=dict)
    wire_bits: Mapping[str, Sequence[float]] = field(default_factory=dict)
    messages: int = 1
    header_bits: int = 0
    dtype_bytes: int = 4
    # measured: a compressed step's cost per coordinate beyond its codec and wire time, by coding (none: 0),
    # and the uncompressed all-reduce's beyond its wire time
    step_ns: Mapping[str, float] = field(default_factory=dict)
    plain_ns: float = 0.0

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) and v >= 0 for v in (*self.step_ns.values(), self.plain_ns)):
            raise ValueError(f"step_ns and plain_ns must be finite and >= 0, got {self.step_ns!r}, {self.plain_ns!r}")
        if not (math.isfinite(self.mbit) and self.mbit > 0):
            raise ValueError(f"link throughput must be a finite rate > 0 Mbit/s, got {self.mbit!r}")
        for name in ("latency_s", "compute_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if set(self.codec_ns) != set(self.wire_bits):
            raise ValueError(f"codec_ns and wire_bits must name the same codings: {sorted(self.codec_ns)} "
                             f"vs {sorted(self.wire_bits)}")
        for c in self.codec_ns:
            if len(self.codec_ns[c]) != len(self.wire_bits[c]) or not self.codec_ns[c]:
                raise ValueError(f"coding {c!r}: one cost and one wire size per width, from width 1")
            if not all(math.isfinite(v) and v >= 0 for v in (*self.codec_ns[c], *self.wire_bits[c])):
                raise ValueError(f"coding {c!r}: costs and sizes must be finite and >= 0")
        if self.messages < 1 or self.header_bits < 0 or self.dtype_bytes < 1:
            raise ValueError("messages >= 1, header_bits >= 0 and dtype_bytes >= 1 are required")

    def direction_s(self, d: int, width: int, coding: str) -> float:
        """Codec, latency and wire seconds of one direction at ``width`` (UNCOMPRESSED: the dtype)."""
        if width == UNCOMPRESSED:
            cpu, bits = 0.0, 8.0 * self.dtype_bytes * d
        else:
            cpu, bits = self.codec_ns[coding][width - 1] * d * 1e-9, self.header_bits + self.wire_bits[coding][width - 1] * d
        return cpu + self.messages * (self.latency_s + bits / (self.mbit * 1e6))

    def step_s(self, d: int, choice: Choice) -> float:
        """T of the module docstring: compute, both directions, and the measured cost of the step's kind
        (``plain_ns`` uncompressed both ways, else ``step_ns`` of its coding) per coordinate."""
        plain = choice.up == UNCOMPRESSED and choice.down == UNCOMPRESSED
        return (self.compute_s + self.direction_s(d, choice.up, choice.coding) + self.direction_s(d, choice.down, choice.coding)
                + d * (self.plain_ns if plain else self.step_ns.get(choice.coding, 0.0)) * 1e-9)


def calibrated(model: TimeModel, d: int, probes: Sequence[tuple[Choice, float]], plain_ns: float) -> TimeModel:
    """``model`` with its ``step_ns`` and ``plain_ns`` set so that it predicts what was measured: a step of
    each probe's choice (compressed, one per coding) that took its ns per coordinate, an uncompressed one
    ``plain_ns`` (all without compute); what the model already prices is not counted twice, and a step
    faster than the model adds nothing (the model's figures are kept)."""
    base = replace(model, compute_s=0.0, step_ns={}, plain_ns=0.0)
    plain = Choice(UNCOMPRESSED, UNCOMPRESSED, "")
    return replace(model, step_ns={c.coding: max(0.0, ns - base.step_s(d, c) * 1e9 / d) for c, ns in probes},
                   plain_ns=max(0.0, plain_ns - base.step_s(d, plain) * 1e9 / d))


def quant_noise(d: int, norm: float, width: int) -> float:
    """q(B) = d·‖g‖²/(6 s_B²): the quantization term of Theorems 1–3 for one message (0 uncompressed)."""
    return 0.0 if width == UNCOMPRESSED else d * norm * norm / (6.0 * levels_for_bits(width) ** 2)


def noise(d: int, norm: float, width: int, q: Sequence[float] | None) -> float:
    """The rounding variance of one message at ``width``: ``q[width − 1]`` where the caller knows it (the
    expected variance at the gradient's own magnitudes, :func:`dqsgd.policies.link.rounding_variances`),
    else the bound :func:`quant_noise`; 0 uncompressed."""
    if width == UNCOMPRESSED or q is None:
        return quant_noise(d, norm, width)
    return q[width - 1]


def objective(model: TimeModel, choice: Choice, *, d: int, norm: float, sigma2: float, workers: int,
              q: tuple[Sequence[float], Sequence[float]] | None = None) -> float:
    """J = ρ·T of the module docstring: predicted seconds to the full-precision accuracy / N_0;
    ``q``: (uplink, downlink) rounding variance of one message by width − 1 in place of the bound q(B)."""
    up, down = (None, None) if q is None else q
    rho = 1.0 + (noise(d, norm, choice.up, up) / workers + noise(d, norm, choice.down, down)) / sigma2
    return rho * model.step_s(d, choice)


def candidates(model: TimeModel, min_bits: int = 2, max_bits: int = 16, uncompressed: bool = True,
               downs: Sequence[int] | None = None) -> list[Choice]:
    """Every (B_u, B_d, coding) the model can price, and "uncompressed" both ways when allowed;
    ``downs``: the downlink widths a caller can send (None: uncompressed and every width)."""
    out = [Choice(UNCOMPRESSED, UNCOMPRESSED, "")] if uncompressed else []
    for c in sorted(model.codec_ns):
        top = min(max_bits, len(model.codec_ns[c]))
        ws = (UNCOMPRESSED, *range(min_bits, top + 1)) if downs is None else [w for w in downs if w <= top]
        out += [Choice(u, w, c) for u in range(min_bits, top + 1) for w in ws]
    return out


def choose(model: TimeModel, *, d: int, norm: float, sigma2: float, workers: int, min_bits: int = 2,
           max_bits: int = 16, uncompressed: bool = True, downs: Sequence[int] | None = None,
           q: tuple[Sequence[float], Sequence[float]] | None = None) -> Choice:
    """The candidate of least J (all of them are priced: a few hundred); ties go to the earliest in :func:`candidates`
    (uncompressed first, then codings by name, narrower first), so every rank picks the same one."""
    if not (d > 0 and workers > 0 and math.isfinite(norm) and norm >= 0 and math.isfinite(sigma2) and sigma2 > 0):
        raise ValueError(f"choose needs d > 0, workers > 0, a finite norm >= 0 and sigma2 > 0 "
                         f"(got d={d}, workers={workers}, norm={norm}, sigma2={sigma2})")
    cands = candidates(model, min_bits, max_bits, uncompressed, downs)
    if not cands:
        raise ValueError("no candidate: state at least one coding or allow uncompressed")
    j = [objective(model, c, d=d, norm=norm, sigma2=sigma2, workers=workers, q=q) for c in cands]
    return cands[min(range(len(cands)), key=j.__getitem__)]  # the first of least J


@dataclass(frozen=True)
class LinkEstimate:
    """Throughput and latency smoothed from timed collectives: each observation (bytes, seconds) of a
    message updates an exponential average of the seconds per byte (for messages of at least
    ``large`` bytes) or of the latency (smaller ones), weight ``smoothing``."""

    s_per_byte: float = 0.0
    latency_s: float = 0.0
    smoothing: float = 0.3
    large: int = 1 << 16

    def observe(self, nbytes: int, seconds: float) -> LinkEstimate:
        if nbytes <= 0 or not (math.isfinite(seconds) and seconds >= 0):
            return self
        a = self.smoothing
        if nbytes >= self.large:
            per = max(seconds - self.latency_s, 0.0) / nbytes
            return replace(self, s_per_byte=per if self.s_per_byte == 0 else (1 - a) * self.s_per_byte + a * per)
        return replace(self, latency_s=seconds if self.latency_s == 0 else (1 - a) * self.latency_s + a * seconds)

    def mbit(self) -> float:
        """Throughput in Mbit/s (0 until a large message was observed)."""
        return 8e-6 / self.s_per_byte if self.s_per_byte > 0 else 0.0


def agree(figures: Sequence[float], reduce_max: Callable[[list[float]], list[float]]) -> list[float]:
    """One set of figures on every rank: ``reduce_max`` is the elementwise max over ranks (an
    all-reduce MAX the caller already performs; the identity in a single process). The slowest rank's
    figures govern, and every rank then decides from the same numbers."""
    out = [float(v) for v in reduce_max([float(v) for v in figures])]
    if len(out) != len(figures):
        raise ValueError(f"reduce_max returned {len(out)} figures for {len(figures)}")
    return out


def time_codec(roundtrip: Callable[[int, str], object], widths: Sequence[int], codings: Sequence[str], n: int,
               repeats: int = 3, cache: dict[tuple[int, int, str], float] | None = None) -> dict[str, list[float]]:
    """ns per coordinate of ``roundtrip(width, coding)`` (encode + decode of an n-coordinate bucket),
    the least of ``repeats`` runs, cached per (n, width, coding) in ``cache``: measured once at warm-up.
    The result is one rank's figures: pass them through :func:`agree` before deciding."""
    cache = {} if cache is None else cache
    out: dict[str, list[float]] = {}
    for c in codings:
        row = []
        for w in widths:
            key = (n, w, c)
            if key not in cache:
                best = math.inf
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    roundtrip(w, c)
                    best = min(best, time.perf_counter() - t0)
                cache[key] = best * 1e9 / n
            row.append(cache[key])
        out[c] = row
    return out


def max_over(group: Any) -> Callable[[list[float]], list[float]]:
    """:func:`agree`'s ``reduce_max`` over a :class:`dqsgd.topology.group.Group`: one max all-reduce, float64."""
    import torch

    return lambda v: group.wait(group.max_reduce(torch.tensor(v, dtype=torch.float64), 0)).tolist()


UNCOMPRESSED_DTYPES = ("bfloat16", "float16")  # the 16-bit dtypes a caller may allow an uncompressed bucket in


def check_uncompressed_dtype(dtype: str | None, method: str, policy: str) -> None:
    """``HookState(uncompressed_dtype=...)``: None (a bucket sent uncompressed keeps its dtype) or the name of
    a 16-bit dtype the link policy may all-reduce it in; only the link policy (``policy == "link"``) sends
    buckets uncompressed by choice."""
    if dtype is not None and dtype not in UNCOMPRESSED_DTYPES:
        raise ValueError(f"uncompressed_dtype must be one of {[None, *UNCOMPRESSED_DTYPES]}, got {dtype!r}")
    if dtype is not None and policy != "link":
        raise ValueError(f"uncompressed_dtype is the dtype the link policy (dqsgd-link) may send a bucket in; "
                         f"method {method!r} has policy {policy!r}")


def on_measured(config: Any, link: tuple[float, float, float] | None) -> Any:
    """A method configuration (a dataclass with ``link_mbit`` and ``link_latency_ms``) on the link a surface
    measured: ``link`` = (Mbit/s, latency s, k) from :func:`measure_link` and :func:`codec_slowdown`, the
    same figures on every rank; None: ``config`` as stated. The rate is k × the link's, so that AUTO, which
    compares modelled codec time with link time, codes at the order k × the model implies
    (:func:`codec_slowdown`); a latency the configuration states is kept."""
    if link is None:
        return config
    return replace(config, link_mbit=link[0] * link[2], link_latency_ms=config.link_latency_ms or 1e3 * link[1])


def measure_link(group: Any, nbytes: int = 1 << 21, repeats: int = 2) -> tuple[float, float]:
    """(Mbit/s, latency s) of one direction of the exchange as ``group`` (a :class:`dqsgd.topology.group.Group`
    of W ranks) runs it: the least of ``repeats`` timed all-to-alls of one byte per rank (the latency) and of
    ``nbytes`` split evenly over the ranks (one direction of an ``nbytes`` payload, as an uplink's all-to-all
    or a ring all-reduce's half); the throughput is ``nbytes`` over the large one's seconds less the
    latency, so the model prices a plain all-reduce of ``nbytes`` (two directions) at what such a ring
    takes. Every rank calls it at the same point; the ranks' figures are then agreed by a max-reduce (the
    slowest rank governs), so every rank holds the same two numbers."""
    import torch

    w = group.size

    def timed(per: int) -> float:
        send, sizes = torch.zeros(per * w, dtype=torch.uint8), [per] * w
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            group.wait(group.all_to_all(send, sizes, sizes, 0))
            best = min(best, time.perf_counter() - t0)
        return best

    per = max(1, nbytes // w)
    latency = timed(1)
    s_per_byte = max(timed(per) - latency, 1e-12) / (per * w)
    lat, spb = agree([latency, s_per_byte], max_over(group))
    return 8e-6 / spb, lat


def codec_slowdown(group: Any, n: int = 1 << 18, width: int = 4, repeats: int = 2) -> float:
    """k: this machine's encode + decode nanoseconds per coordinate of the coded row's coding (RANSX, at
    ``width`` on n Gaussian coordinates, the least of ``repeats``) over AUTO's model of it,
    :data:`dqsgd.codecs.auto.CPU_NS`. Every rank of ``group`` times it at the same moment, so the ranks'
    contention for the machine's cores is in it; the ranks' figures are max-reduced (the same k on every
    rank). The caller prices every coding's modelled cost times k, and runs AUTO at k times the link's
    rate: the same order of codings at every size (both sides of AUTO's comparison divided by k)."""
    import torch

    from dqsgd.codecs.auto import CPU_NS
    from dqsgd.codecs.header import Coding
    from dqsgd.codecs.wire import decode, encode
    from dqsgd.quantizers.uniform import quantize_uniform

    q = quantize_uniform(torch.randn(n, generator=torch.Generator().manual_seed(0)), width,
                         torch.Generator().manual_seed(1))
    ns = time_codec(lambda w, c: decode(encode(q, Coding.RANSX)), [width], ["rans"], n, repeats)["rans"][0]
    k = max(ns / CPU_NS[Coding.RANSX], 1e-3)
    return agree([k], max_over(group))[0]
