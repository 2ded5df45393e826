"""Methods: named, validated compositions of quantizer, coding, bit policy, memory, aggregation.

``method_config("qsgd", bits=4)`` returns a frozen, validated :class:`MethodConfig`;
``METHODS`` lists every registered name with a one-line description. Unknown names, unknown
fields and bad hyperparameters are refused up front with a message that says what is allowed.
Names of the form ``qsgd-<B>bit`` are accepted as ``qsgd`` with ``bits=B``, and ``qsgd-<B>bit-<CODING>``
(``qsgd-2bit-auto``, ``qsgd-4bit-elias``: QSGD's own Elias coding) as that with ``coding=CODING``.

What a scheme allows (its widths, whether a bit policy may drive it) comes from the quantizer
registry, ``dqsgd.quantizers.registry``, loaded when the first configuration is built (it loads
torch; listing ``METHODS`` does not).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from dqsgd.core.ranges import check_sketch
from dqsgd.quantizers.constants import TERNGRAD_CLIP

if TYPE_CHECKING:
    from dqsgd.quantizers.registry import Quantizer

Scheme = str  # a method scheme of the quantizer registry: dqsgd.quantizers.registry.method_schemes()
PolicyName = Literal["fixed", "dqsgd", "dqsgd-budget", "dqsgd-coded", "dqsgd-error", "adaptive", "adaqs", "link",
                     "sparse-budget"]
CodingName = Literal["fixed", "elias", "zstd", "zstd-aligned", "rans", "ransx", "auto"]
KernelName = Literal["torch", "fused"]

_ALLOWED: dict[str, tuple[str, ...]] = {
    "policy": ("fixed", "dqsgd", "dqsgd-budget", "dqsgd-coded", "dqsgd-error", "adaptive", "adaqs", "link",
               "sparse-budget"),
    "coding": ("fixed", "elias", "zstd", "zstd-aligned", "rans", "ransx", "auto"),
    "norm": ("inf", "2"),
    "aggregate": ("mean", "majority"),
    "downlink": ("fp32", "sign"),
    "rounding": ("nearest", "ceil", "floor", "carry"),
    "kernel": ("torch", "fused"),
}


@dataclass(frozen=True)
class MethodConfig:
    """Everything that defines a method. Fields not used by a scheme/policy keep their defaults."""

    name: str = "sgd"
    scheme: Scheme = "identity"
    bits: int = 32                  # fixed width (uniform: 2..16); the start width B_0 of dynamic policies
    norm: Literal["inf", "2"] = "inf"
    bucket: int = 0                 # uniform: coordinates per norm bucket; 0 = whole gradient
    per_tensor: bool = False        # one scale per parameter tensor (TernGrad, scaled sign)
    coding: CodingName = "fixed"
    # coding "auto" only: > 0 sends the coding whose modelled encode + decode time plus its bytes on a link of
    # this many Mbit/s is least (dqsgd.codecs.auto.CPU_NS), instead of the smallest; 0 = the smallest.
    link_mbit: float = 0.0
    # policy "link" (with link_mbit > 0): the stated latency per message and forward + backward time per
    # step that its time model adds to the codec's and the wire's (docs/algorithms.md §11.5c).
    link_latency_ms: float = 0.0
    compute_ms: float = 0.0
    # policy "link": its statistics (and so its choice) re-evaluated every this many steps (docs/algorithms.md §11.5c)
    link_every: int = 10
    policy: PolicyName = "fixed"
    # DQSGD: k (convex, eq. 18) or t (non-convex, eq. 20), alpha, horizon from the run.
    k: float = 1.0
    alpha: float = 1.0
    convex: bool = False
    rounding: Literal["nearest", "ceil", "floor", "carry"] = "nearest"
    # Budgeted DQSGD: total per-worker uplink budget in bits, or a target mean bits/coordinate
    # (policy "dqsgd-coded": coded bits on the wire per coordinate).
    budget_bits: int = 0
    target_bits: float = 0.0
    # Error-target DQ-SGD [OC]: eps_q on the quantization term, with smoothness L and step size.
    eps_q: float = 0.0
    smoothness: float = 1.0
    lr: float = 0.1
    min_bits: int = 2
    max_bits: int = 16
    calib_steps: int = 10           # adaptive: steps to calibrate eps_A; adaqs: reference steps
    error_feedback: bool = False
    aggregate: Literal["mean", "majority"] = "mean"
    downlink: Literal["fp32", "sign"] = "fp32"
    scaled_sign: bool = False
    clip: float = TERNGRAD_CLIP     # TernGrad clip factor c (0 = max-norm scaler)
    # Uniform scheme only: "fused" (the default) = the compiled kernels of dqsgd.kernels with hash
    # uniforms of (seed, step, worker); "torch" = torch ops + the worker's torch.Generator (other
    # schemes: torch). Both are unbiased with the same variance; their payloads differ.
    kernel: KernelName = "fused"
    # Sketched SGD (scheme "sketch", dqsgd.topology.sketched): k = max(1, round(topk_ratio·d)) coordinates per step,
    # an r × c count sketch with r = sketch_rows and c = ⌈sketch_cols·k⌉, and ⌈sketch_p·k⌉ candidates whose
    # exact values the second round fetches; the workers' momentum sketch_momentum (the optimizer's should be 0).
    topk_ratio: float = 0.01       # 1% of d, the setting of results/sketch-fashion
    sketch_rows: int = 5
    sketch_cols: float = 2.0
    sketch_p: float = 2.0
    sketch_momentum: float = 0.9    # ρ of the workers' momentum (masked where coordinates were sent)
    description: str = ""

    def __post_init__(self) -> None:
        for fname, allowed in {"scheme": _registry().method_schemes(), **_ALLOWED}.items():
            if getattr(self, fname) not in allowed:
                raise ValueError(f"method {self.name!r}: {fname} must be one of {allowed}, got {getattr(self, fname)!r}")
        _validate(self)

    @property
    def dynamic(self) -> bool:
        return self.policy != "fixed"

    @property
    def quantizer(self) -> Quantizer:
        """The registry entry of this method's scheme."""
        return _registry().quantizer(self.scheme)

    def nominal_bits(self) -> int:
        """Code width at a fixed policy (and B_0 of a dynamic one)."""
        return self.quantizer.nominal_bits(self.bits)

    def budget_text(self) -> str:
        """The method's width or budget in words (the states' reprs): ``"4 bits"``, ``"policy dqsgd-budget,
        target 4.5 bits/coordinate"``, …"""
        if self.policy == "fixed":
            return f"{self.nominal_bits()} bits"
        what = (f"budget {self.budget_bits} bits" if self.budget_bits else
                f"target {self.target_bits:g} bits/coordinate" if self.target_bits else
                f"from {self.bits} bits in {self.min_bits}..{self.max_bits}")
        return f"policy {self.policy}, {what}"


def _registry() -> Any:
    """``dqsgd.quantizers.registry``, imported on first use (it loads torch; ``METHODS`` does not)."""
    from dqsgd.quantizers import registry

    return registry


def _fail(cfg: MethodConfig, msg: str) -> None:
    raise ValueError(f"method {cfg.name!r}: {msg}")


def _validate(c: MethodConfig) -> None:
    q = c.quantizer
    bits_error = q.bits_error(c.bits)
    if bits_error:
        _fail(c, bits_error)
    if not q.dynamic and c.policy != "fixed":
        dynamic = [n for n in _registry().method_schemes() if _registry().quantizer(n).dynamic and n not in SPARSE]
        _fail(c, f"policy {c.policy!r} needs the {' or '.join(dynamic)} scheme")
    if c.bucket < 0:
        _fail(c, f"bucket must be >= 0 (0 = one bucket), got {c.bucket}")
    if not 2 <= c.min_bits <= c.max_bits <= 16:
        _fail(c, f"need 2 <= min_bits <= max_bits <= 16, got [{c.min_bits}, {c.max_bits}]")
    if c.dynamic and not c.min_bits <= c.bits <= c.max_bits:
        _fail(c, f"initial bits {c.bits} outside [min_bits, max_bits] = [{c.min_bits}, {c.max_bits}]")
    if not (c.k > 0 and math.isfinite(c.k)):
        _fail(c, f"k (or t) must be > 0, got {c.k}")
    if not 0 < c.alpha <= 1:
        _fail(c, f"alpha must be in (0, 1], got {c.alpha}")
    if c.policy in ("dqsgd-budget", "dqsgd-coded"):
        if (c.budget_bits > 0) == (c.target_bits > 0):
            _fail(c, "a budgeted policy needs exactly one of budget_bits > 0 or target_bits > 0")
    if c.policy == "dqsgd-budget":
        if c.target_bits and not c.min_bits <= c.target_bits <= c.max_bits:
            _fail(c, f"target_bits {c.target_bits} outside [min_bits, max_bits] = [{c.min_bits}, {c.max_bits}]")
        if c.coding not in ("fixed", "auto"):
            _fail(c, "a budgeted policy needs coding 'fixed' or 'auto' (whose size never exceeds fixed)")
    if c.policy == "dqsgd-coded":
        if c.target_bits and not 0 < c.target_bits <= c.max_bits:
            _fail(c, f"target_bits (coded bits per coordinate) {c.target_bits} outside (0, max_bits = {c.max_bits}]")
        if c.coding != "auto":
            _fail(c, "the coded budget needs coding 'auto' (it spends coded bytes; auto never exceeds the "
                     "fixed size, which bounds its cost estimates)")
    if c.policy == "link":
        if c.coding != "auto":
            _fail(c, "the link policy needs coding 'auto' (which then sends the coding of least modelled time, as "
                     "the policy prices it)")
        if not all(math.isfinite(v) and v >= 0 for v in (c.link_latency_ms, c.compute_ms)):
            _fail(c, f"link_latency_ms and compute_ms must be finite and >= 0, got {c.link_latency_ms}, {c.compute_ms}")
        if isinstance(c.link_every, bool) or not isinstance(c.link_every, int) or c.link_every < 1:
            _fail(c, f"link_every (steps between the link policy's re-evaluations) must be an integer >= 1, "
                     f"got {c.link_every!r}")
    if c.policy == "dqsgd-error" and not (c.eps_q > 0 and c.smoothness > 0 and c.lr > 0):
        _fail(c, "the error-target policy needs eps_q > 0, smoothness (L) > 0 and lr > 0")
    if c.policy == "dqsgd-error" and not c.smoothness * c.lr < 2:
        _fail(c, f"the error-target policy needs L·lr < 2 (the bounds of Theorems 1/3), got {c.smoothness * c.lr}")
    if not (math.isfinite(c.link_mbit) and c.link_mbit >= 0):
        _fail(c, f"link_mbit must be a finite rate >= 0 (0 = the smallest coding), got {c.link_mbit}")
    if c.link_mbit and c.coding != "auto":
        _fail(c, f"link_mbit chooses among the codings of coding 'auto'; coding is {c.coding!r}")
    if c.calib_steps < 1:
        _fail(c, f"calib_steps must be >= 1, got {c.calib_steps}")
    if c.clip < 0:
        _fail(c, f"TernGrad clip must be >= 0, got {c.clip}")
    if c.aggregate == "majority" and c.scheme != "sign":
        _fail(c, "majority-vote aggregation needs the sign scheme")
    if c.downlink == "sign" and c.aggregate != "majority":
        _fail(c, "a 1-bit sign downlink needs majority-vote aggregation")
    if c.scheme == "sketch":
        _validate_sketch(c)
    if c.error_feedback and c.aggregate == "majority":
        _fail(c, "error feedback with majority vote is not a defined method; use ef-signsgd (mean of scaled signs)")
    if c.scheme in SPARSE or c.policy == "sparse-budget":
        _validate_sparse(c)


SPARSE = ("topk", "randk")  # the sparsifiers (dqsgd.quantizers.sparse): Local SGD's sparse pseudo-gradients


def _validate_sparse(c: MethodConfig) -> None:
    if c.scheme not in SPARSE:
        _fail(c, f"policy 'sparse-budget' chooses the width and density of a sparse scheme ({' or '.join(SPARSE)})")
    if c.policy not in ("fixed", "sparse-budget"):
        _fail(c, f"a sparse scheme runs at a fixed width and density (policy 'fixed') or under policy 'sparse-budget', "
                 f"which prices its messages; not {c.policy!r}")
    if not 0 < c.topk_ratio <= 1:
        _fail(c, f"topk_ratio (the density k/d) must be in (0, 1], got {c.topk_ratio}")
    if c.coding != "fixed" or c.per_tensor or c.bucket or c.norm != "inf":
        _fail(c, "a sparse message sends its indices and FIXED-coded values with one max-norm scale: leave coding, "
                 "per_tensor, bucket and norm at their defaults")
    if c.policy == "sparse-budget":
        if (c.budget_bits > 0) == (c.target_bits > 0):
            _fail(c, "the sparse budget needs exactly one of budget_bits > 0 or target_bits > 0 (bits per coordinate "
                     "and round, indices included)")
        if c.target_bits and not 0 < c.target_bits <= c.max_bits:
            _fail(c, f"target_bits {c.target_bits} outside (0, max_bits = {c.max_bits}]")


def check_one_message(c: MethodConfig, who: str) -> None:
    """Refuse a method that ``who`` (the DDP hook, FSDP, the one-message pipeline) cannot run: Sketched
    SGD sends count sketches in two rounds, which only the trainer's step runs."""
    if c.scheme == "sketch":
        _fail(c, f"sends count sketches in two rounds: the trainer runs it (dqsgd train, "
                 f"dqsgd.topology.sketched.SketchedStep); {who} does not")
    if c.scheme in SPARSE:
        _fail(c, f"sends indices and quantized values of Local SGD's pseudo-gradients: Local SGD runs it "
                 f"(dqsgd.local.LocalSGDOptimizer, dqsgd train with local_steps); {who} does not")


def check_fed_policy(c: MethodConfig, who: str) -> None:
    """Refuse the ``link`` policy where ``who`` (FSDP, Local SGD, the trainer over processes on a
    topology that does not run the bucket's exchange) neither holds every worker's gradient nor gathers
    their norms: the policy estimates the gradient noise from them and, never fed, would keep its start
    width while its name says it adapts."""
    if c.policy == "link":
        _fail(c, f"policy 'link' estimates the gradient noise from every worker's gradient norm, which dqsgd "
                 f"train's in-process simulation holds and the bucket's exchange gathers (the DDP hook on sharded "
                 f"or allgather, dqsgd train on sharded); {who} does not feed it (it would keep its start width): "
                 "use dqsgd or dqsgd-coded there")


def _validate_sketch(c: MethodConfig) -> None:
    if not 0 < c.topk_ratio <= 1:
        _fail(c, f"topk_ratio must be in (0, 1], got {c.topk_ratio}")
    if not 0 <= c.sketch_momentum < 1:
        _fail(c, f"sketch_momentum must be in [0, 1), got {c.sketch_momentum}")
    try:
        check_sketch(c.sketch_rows, c.sketch_cols, c.sketch_p)
    except ValueError as e:
        _fail(c, str(e))
    if c.error_feedback or c.aggregate != "mean" or c.downlink != "fp32" or c.coding != "fixed":
        _fail(c, "sketched SGD accumulates its own error on the workers and sends fp32 sums: leave "
                 "error_feedback, aggregate, downlink and coding at their defaults")


_PRESETS: dict[str, dict[str, Any]] = {
    "sgd": dict(scheme="identity", description="Vanilla SGD: fp32 gradients (DQSGD Table 1, first row)"),
    "signsgd": dict(scheme="sign", bits=1, aggregate="majority", downlink="sign",
                    description="signSGD with majority vote: 1 bit up, 1 bit down (Bernstein et al. 2019)"),
    "ef-signsgd": dict(scheme="sign", bits=1, scaled_sign=True, per_tensor=True, error_feedback=True,
                       description="EF-SignSGD: l1-scaled sign per tensor with error feedback (Karimireddy et al. 2019)"),
    "terngrad": dict(scheme="ternary", bits=2, per_tensor=True, clip=TERNGRAD_CLIP,
                     description="TernGrad: stochastic ternary, shared per-tensor scalers, clip 2.5σ (Wen et al. 2017)"),
    "qsgd": dict(scheme="uniform", bits=4, description="QSGD: stochastic uniform, fixed B bits, max-norm (Alistarh et al. 2017)"),
    "adaptive": dict(scheme="uniform", bits=8, policy="adaptive", min_bits=2, max_bits=8,
                     description="Adaptive [OC rule]: bits from the gradient RMS (Oland & Raj 2015)"),
    "adaqs": dict(scheme="uniform", bits=4, policy="adaqs", min_bits=2, max_bits=8, calib_steps=100,
                  description="AdaQS [OC rule]: bits from the mean-to-std ratio, rising (Guo et al. 2020)"),
    "dqsgd": dict(scheme="uniform", bits=6, policy="dqsgd-budget", target_bits=4.5,
                  description="DQSGD, budgeted: eq. (20) widths with t solved online to meet a bit budget"),
    "dqsgd-coded": dict(scheme="uniform", bits=6, policy="dqsgd-coded", coding="auto", target_bits=1.0,
                        description="DQSGD, byte-budgeted: eq. (20) widths costed by their predicted entropy-coded "
                                    "size; a budget of coded bits"),
    "dqsgd-link": dict(scheme="uniform", bits=4, policy="link", coding="auto", link_mbit=100.0, max_bits=8,
                       description="DQSGD from the link [OC]: each step the width of least predicted time to the "
                                   "full-precision accuracy, from link_mbit, the codec's cost and the gradient noise"),
    "dqsgd-convex": dict(scheme="uniform", bits=6, policy="dqsgd", convex=True, k=20.0, alpha=0.999,
                         description="DQSGD strongly convex rule, eq. (18): B = log2(k·α^((N-n)/2)·‖g‖+1)+1"),
    "dqsgd-nonconvex": dict(scheme="uniform", bits=6, policy="dqsgd", k=20.0,
                            description="DQSGD non-convex rule, eq. (20): B = log2(t·‖g‖+1)+1 (t given as k)"),
    "sketched-sgd": dict(scheme="sketch", bits=32,
                         description="Sketched SGD: count sketches summed, top-k from the sum, their exact values "
                                     "in a second round, error accumulation on the workers (Ivkin et al. 2019)"),
    "dqsgd-error": dict(scheme="uniform", bits=6, policy="dqsgd-error", eps_q=1e-3,
                        description="DQ-SGD error target [OC]: fewest bits with the quantization term <= eps_q"),
    "topk": dict(scheme="topk", bits=2, topk_ratio=0.01, error_feedback=True,
                 description="Local SGD top-k [OC]: the largest 1% of the pseudo-gradient, indices + 2-bit values, "
                             "error feedback (as SparseLoCo)"),
    "randk": dict(scheme="randk", bits=4, topk_ratio=0.01,
                  description="Local SGD random-k [OC]: a uniform 1% of the pseudo-gradient scaled by d/k (unbiased), "
                              "indices + 4-bit values"),
    "topk-budget": dict(scheme="topk", bits=2, policy="sparse-budget", target_bits=0.25, max_bits=8,
                        error_feedback=True,
                        description="Local SGD top-k under a byte budget [OC]: each round's value width and density "
                                    "of least predicted error within the round's share of the budget"),
}

METHODS: dict[str, str] = {name: p["description"] for name, p in _PRESETS.items()}
_QSGD_ALIAS = re.compile(r"^qsgd-(\d+)bits?(?:-(" + "|".join(map(re.escape, get_args(CodingName))) + r"))?$")
FIELDS = tuple(f.name for f in dataclasses.fields(MethodConfig))


def method_config(name: str, **overrides: Any) -> MethodConfig:
    """The registered method ``name`` with ``overrides`` applied and validated."""
    alias = _QSGD_ALIAS.match(name)
    base = _PRESETS.get(name)
    if alias:
        base = dict(_PRESETS["qsgd"], bits=int(alias.group(1)), **({"coding": alias.group(2)} if alias.group(2) else {}))
    if base is None:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(sorted(METHODS))} (and qsgd-<B>bit, "
                         f"qsgd-<B>bit-<coding>)")
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise ValueError(f"method {name!r}: unknown option(s) {unknown}; allowed: {', '.join(FIELDS)}")
    for key, value in overrides.items():
        _check_type(name, key, value)
    return MethodConfig(**{**base, "name": name, **overrides})


def _check_type(name: str, key: str, value: Any) -> None:
    expected = type(getattr(MethodConfig(), key))
    ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise TypeError(f"method {name!r}: option {key} must be {expected.__name__}, got {value!r}")
