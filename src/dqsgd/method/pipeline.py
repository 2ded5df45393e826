"""A configured method for one model: the worker half and the server half of DQSGD Algorithm 2.

    worker:  g ──► [memory] ──► quantize(g, B_n) ──► codec.encode ──► bytes
    server:  bytes ──► codec.decode ──► aggregate ──► G ──► policy ──► B_{n+1};  G ──► downlink bytes

Both transports (the in-process simulation and torch.distributed) call exactly these functions,
so the same seed gives the same bits and the same model on both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from dqsgd.codecs import (
    Coding, PayloadError, coded_size, decode as decode_payload, encode as encode_payload, predicted_size,
)
from dqsgd.kernels import HashRNG, encode_uniform_fast, quantize_uniform_fast
from dqsgd.method import memory
from dqsgd.method.config import MethodConfig, check_one_message
from dqsgd.policies import (
    AdaptiveRMS, AdaQS, BudgetedDQSGD, CodedBudgetedDQSGD, DQSGDRule, FixedBits, GradStats, LinkPolicy, PolicyState,
    Rounding, Spent, grad_stats,
)
from dqsgd.policies.sparse_budget import budget_policy
from dqsgd.quantizers import Layout, Norm, Quantized, Scheme, dequantize


class ProtocolError(ValueError):
    """A message that decodes but is not what this step expects (wrong size, width or scheme)."""


@dataclass
class MethodState:
    """Everything a method carries between steps (checkpointed as a whole).

    ``policy`` is None on a rank that does not run the bit policy (a ps rank other than the server):
    it holds only ``bits``, the width the server announced with the last downlink. Where the policy
    runs, ``bits`` is its state's width (given or not).
    """

    policy: PolicyState | None            # the bit policy's state; .bits is the width of the next step
    residuals: list[torch.Tensor | None]  # error-feedback memory, one per worker (None: no memory yet)
    bits: int = -1                        # the width of the next step, B_n
    down_residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # error-fed downlink: shard j's
                                          # server residual e_j (the shards this process serves)

    def __post_init__(self) -> None:
        if self.policy is not None:
            if self.bits not in (-1, int(self.policy.bits)):
                raise ValueError(f"width {self.bits} given for a policy state of width {self.policy.bits}")
            self.bits = int(self.policy.bits)
        elif isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits < 1:
            raise ValueError(f"a method state without a policy state needs its width, bits >= 1, got {self.bits!r}")


class Method:
    """``config`` applied to a model with ``numel`` parameters (``param_sizes`` per tensor)."""

    def __init__(self, config: MethodConfig, numel: int, total_steps: int, param_sizes: Sequence[int] | None = None):
        if numel < 0 or total_steps < 1:
            raise ValueError(f"need numel >= 0 and total_steps >= 1, got {numel}, {total_steps}")
        self.config, self.numel, self.total_steps = config, numel, total_steps
        self.quantizer = config.quantizer
        sizes = tuple(int(s) for s in param_sizes) if param_sizes is not None else (numel,)
        if sum(sizes) != numel:
            raise ValueError(f"param_sizes sum to {sum(sizes)}, not numel = {numel}")
        self.layout = Layout(sizes=sizes) if config.per_tensor else Layout(bucket=config.bucket)
        self.coding = Coding.from_name(config.coding)
        self.norm = Norm.MAX if config.norm == "inf" else Norm.L2
        self.p = math.inf if config.norm == "inf" else 2.0
        self.policy = self._make_policy()

    # --- set-up ---------------------------------------------------------------------------------
    def message_bits(self, bits: int) -> int:
        """Exact size in bits of one fixed-coded uplink message at width ``bits``."""
        nseg = self.layout.num_segments(self.numel)
        return 8 * predicted_size(self.numel, bits, nseg, 1, self.layout, Coding.FIXED)

    def max_payload_bytes(self, bits: int) -> int:
        """The largest uplink payload this method can produce at width ``bits``: a receiver refuses a
        larger announced size before it allocates anything.

        FIXED coding: the exact size. Entropy codings (Elias ω, rANS, zstd): the FIXED size + 8 bytes
        per coordinate + a table allowance — an upper bound (an Elias ω code of a 16-bit level takes
        < 32 bits, a rANS symbol < bits + 1 bits, zstd expands incompressible data by < 1%), not a
        tight one; it keeps the allocation linear in the model, which is what the cap is for.
        """
        b = self.width(bits)
        nseg = self.layout.num_segments(self.numel) if self.quantizer.segment_scales else 0
        fixed = predicted_size(self.numel, b, nseg, 1, self.layout, Coding.FIXED)
        return fixed if self.coding == Coding.FIXED else fixed + 8 * self.numel + 8 * (1 << min(b, 16)) + 4096

    def width(self, bits: int) -> int:
        """The width of an uplink message at policy width ``bits``: ``bits`` for a scheme of dynamic
        width, else the scheme's nominal width."""
        return bits if self.quantizer.dynamic else self.config.nominal_bits()

    def budget_bits(self) -> int | None:
        c = self.config
        if c.policy not in ("dqsgd-budget", "dqsgd-coded"):
            return None
        if c.budget_bits:
            return c.budget_bits
        header = self.message_bits(c.min_bits) - self.numel * c.min_bits
        return int(math.floor(self.total_steps * (header + self.numel * c.target_bits)))

    def _make_policy(self) -> Any:
        factory = POLICIES.get(self.config.policy)
        if factory is None:
            raise ValueError(f"unknown policy {self.config.policy!r}: use one of {', '.join(POLICIES)}")
        return factory(self)

    def init_state(self, workers: int, policy: Any = None) -> MethodState:
        """The state before step 0 for ``workers`` workers; ``policy``: the policy that runs (None: the
        method's own; a bucket protocol may run another over it, :attr:`BucketProtocol.policy`)."""
        if workers < 1:
            raise ValueError(f"need at least one worker, got {workers}")
        return MethodState((self.policy if policy is None else policy).init(), [None] * workers)

    # --- worker side ----------------------------------------------------------------------------
    @property
    def shares_scalers(self) -> bool:
        """TernGrad's scaler sharing: workers max-reduce per-tensor scalers before quantizing."""
        return self.quantizer.shares_scalers

    def local_scalers(self, grad: torch.Tensor) -> torch.Tensor:
        return self.quantizer.scalers(grad, layout=self.layout, clip=self.config.clip)

    @property
    def fused(self) -> bool:
        """Uniform quantization through the fused CPU kernels, with hash uniforms (``kernel = "fused"``)."""
        return self.config.kernel == "fused" and self.quantizer.fused

    def compress(self, grad: torch.Tensor, bits: int, generator: torch.Generator | None,
                 scalers: torch.Tensor | None = None, hash_rng: HashRNG | None = None) -> Quantized:
        c = self.config
        if grad.numel() != self.numel:
            raise ValueError(f"gradient has {grad.numel()} elements, the method was built for {self.numel}")
        if self.quantizer.scheme == Scheme.SKETCH:
            check_one_message(c, "the one-message pipeline")
        if self.fused:
            return quantize_uniform_fast(grad, bits, self._need_rng(hash_rng), norm=self.norm, layout=self.layout)
        return self.quantizer.quantize(grad, bits, generator, layout=self.layout, norm=self.norm,
                                       scaled=c.scaled_sign, scalers=scalers, clip=c.clip)

    def _need_rng(self, hash_rng: HashRNG | None) -> HashRNG:
        if hash_rng is None:
            raise ValueError(f"method {self.config.name!r}: kernel 'fused' draws hash uniforms: pass "
                             "hash_rng=HashRNG(seed, step, worker) (the same on every transport)")
        return hash_rng

    def encode(self, grad: torch.Tensor, bits: int, generator: torch.Generator | None,
               residual: torch.Tensor | None = None, scalers: torch.Tensor | None = None,
               hash_rng: HashRNG | None = None) -> tuple[bytes, torch.Tensor | None]:
        """One worker's uplink message for this step, and its new error-feedback residual.

        ``hash_rng`` (kernel "fused" only, where it replaces ``generator``): the uniforms of this
        (seed, step, worker).
        """
        flat = grad.detach().reshape(-1)
        if not self.config.error_feedback:
            if self.fused:  # the fused kernel's payload: packed there, or its codes counted in the same pass
                if flat.numel() != self.numel:
                    raise ValueError(f"gradient has {flat.numel()} elements, the method was built for {self.numel}")
                if flat.device.type == "cuda" and self.coding == Coding.FIXED:  # the device codec: same bytes
                    from dqsgd.kernels.device import encode_uniform_device

                    return encode_uniform_device(flat, bits, self._need_rng(hash_rng), norm=self.norm,
                                                 layout=self.layout).cpu().numpy().tobytes(), None
                return encode_uniform_fast(flat, bits, self._need_rng(hash_rng), norm=self.norm, layout=self.layout,
                                           coding=self.coding, link_mbit=self.config.link_mbit), None
            q = self.compress(flat, bits, generator, scalers, hash_rng)
            return encode_payload(q, self.coding, link_mbit=self.config.link_mbit), None
        p = memory.compensate(flat, residual)
        q = self.compress(p, bits, generator, scalers, hash_rng)
        return encode_payload(q, self.coding, link_mbit=self.config.link_mbit), memory.update(p, dequantize(q))

    def coded_size(self, payload: bytes) -> int:
        """The bytes ``payload``'s levels would take with the best coding (:func:`dqsgd.codecs.coded_size`,
        capped at this method's d elements); fp32 payloads count their own length. A measurement only:
        what is sent is ``payload``. A method that codes with ``auto`` already sent exactly that
        encoding of its own levels (AUTO is deterministic and decode is exact), so its payload's length
        is the answer without decoding and encoding it again (by size: not with a ``link_mbit``)."""
        if self.coding == Coding.AUTO and not self.config.link_mbit:
            return len(payload)
        return coded_size(payload, max_numel=max(self.numel, 1))

    # --- server side ----------------------------------------------------------------------------
    def decode_uplink(self, payload: bytes, bits: int, worker: int) -> Quantized:
        try:
            q = decode_payload(payload, max_numel=max(self.numel, 1))
        except PayloadError as e:
            raise PayloadError(f"worker {worker}: {e}") from None
        self.check_uplink(q.scheme, q.numel, q.bits, bits, worker)
        return q

    def check_uplink(self, scheme: Scheme, numel: int, got_bits: int, bits: int, worker: int) -> None:
        expected, want_bits = self.quantizer.scheme, self.width(bits)
        if scheme != expected or numel != self.numel or got_bits != want_bits:
            raise ProtocolError(
                f"worker {worker}: expected a {expected.name} message of {self.numel} values at {want_bits} bits, "
                f"got {scheme.name} with {numel} values at {got_bits} bits"
            )

    def observe(self, state: MethodState, aggregated: torch.Tensor, step: int, spent_bits: Spent,
                policy: Any = None) -> MethodState:
        """Server: the policy sees step n's aggregate and picks B_{n+1} (Algorithm 2, line 12).
        ``spent_bits``: the step's bits, or (bits, a coded downlink's real bits among them); ``policy``:
        the policy that runs (None: the method's own)."""
        policy = self.policy if policy is None else policy
        if state.policy is None:
            raise ValueError("observe: this method state holds no policy state (a rank that only receives the width)")
        stats: GradStats = grad_stats(aggregated, step, spent_bits, self.p, keep=policy.needs_grad)
        return MethodState(policy.update(state.policy, stats), state.residuals, down_residuals=state.down_residuals)


def _dqsgd_error(m: Method) -> DQSGDRule:
    import dqsgd.theory.formulas as theory

    c, n = m.config, m.total_steps
    k = (theory.error_target_k(n, c.smoothness, m.numel, c.lr, c.alpha, c.eps_q) if c.convex
         else theory.error_target_t(c.smoothness, c.lr, m.numel, c.eps_q))
    return DQSGDRule(k, n, c.alpha, c.convex, c.bits, c.min_bits, c.max_bits, Rounding(c.rounding), name="dqsgd-error")


def _link_mbit(c: MethodConfig) -> float:
    """The link policy's rate: ``link_mbit`` 0 is the link a surface measures (the DDP hook, dqsgd train over
    processes), which then builds the method with the measured rate; elsewhere there is none to measure."""
    if not c.link_mbit > 0:
        raise ValueError(f"method {c.name!r}: the link policy with link_mbit = 0 takes the link's rate from the DDP "
                         "hook's or dqsgd train --transport torch's measurement; here there is no link to measure: "
                         "state link_mbit (the link's Mbit/s), or use a stated budget (dqsgd, dqsgd-coded)")
    return c.link_mbit


# The bit policies by name (``MethodConfig.policy``): each builds the policy of a method.
POLICIES: dict[str, Callable[[Method], Any]] = {
    "fixed": lambda m: FixedBits(m.config.nominal_bits()),
    "dqsgd": lambda m: DQSGDRule(m.config.k, m.total_steps, m.config.alpha, m.config.convex, m.config.bits,
                                 m.config.min_bits, m.config.max_bits, Rounding(m.config.rounding)),
    "dqsgd-error": _dqsgd_error,
    "dqsgd-budget": lambda m: BudgetedDQSGD(m.budget_bits() or 0, m.total_steps, m.numel, m.message_bits,
                                            m.config.convex, m.config.alpha, m.config.min_bits, m.config.max_bits),
    "dqsgd-coded": lambda m: CodedBudgetedDQSGD(m.budget_bits() or 0, m.total_steps, m.numel, m.message_bits,
                                                m.config.convex, m.config.alpha, m.config.min_bits, m.config.max_bits,
                                                start_bits=m.config.bits),
    "link": lambda m: LinkPolicy(max(m.numel, 1), _link_mbit(m.config), m.message_bits(m.config.min_bits)
                                 - m.numel * m.config.min_bits, m.config.bits, compute_s=m.config.compute_ms / 1e3,
                                 latency_s=m.config.link_latency_ms / 1e3, min_bits=m.config.min_bits,
                                 max_bits=m.config.max_bits, every=m.config.link_every),
    "adaptive": lambda m: AdaptiveRMS(m.config.bits, m.config.min_bits, m.config.max_bits, m.config.calib_steps),
    "adaqs": lambda m: AdaQS(m.numel, m.config.bits, m.config.min_bits, m.config.max_bits, m.config.calib_steps),
    "sparse-budget": lambda m: budget_policy(m.config, m.numel, m.total_steps),  # one message; the sharded step's own
}
