"""Bit policies: who decides B_n, from what, and how a real-valued width becomes an integer.

A policy is a pair of pure functions in the optax style:

    state = policy.init()
    bits  = state.bits                      # B_0, known to every rank before step 0
    state = policy.update(state, stats)     # server: observe step n's aggregate -> B_{n+1}

``stats`` (:class:`GradStats`) is computed once, on the server (or identically on every peer),
from the *aggregated* gradient G(x^(n)) as in DQSGD Algorithm 2, so every rank reaches the same
B_{n+1}. States are frozen dataclasses of plain numbers (and tensors for AdaQS) so checkpoints
can save them with ``torch.save`` and load them with ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch


class Rounding(enum.Enum):
    """How a real-valued width B* becomes an integer code width (then clipped to [min, max]).

    NEAREST: round half up, ⌊B* + ½⌋.  CEIL: ⌈B*⌉ (never fewer bits than the rule asks).
    FLOOR: ⌊B*⌋.  CARRY: error diffusion — B = ⌊B* + c⌋, c ← B* + c − B; over many steps the
    integer widths average to the real ones (what the budgeted policy uses to land on C).
    """

    NEAREST = "nearest"
    CEIL = "ceil"
    FLOOR = "floor"
    CARRY = "carry"


def integerize(real_bits: float, mode: Rounding, carry: float, lo: int, hi: int) -> tuple[int, float]:
    """Integer width for real width ``real_bits``; returns (bits, new carry). Clipped to [lo, hi]."""
    if not math.isfinite(real_bits):
        raise ValueError(f"bit policy produced a non-finite width {real_bits}")
    if mode is Rounding.NEAREST:
        b = math.floor(real_bits + 0.5)
    elif mode is Rounding.CEIL:
        b = math.ceil(real_bits - 1e-9)
    elif mode is Rounding.FLOOR:
        b = math.floor(real_bits + 1e-9)
    else:
        b = math.floor(real_bits + carry + 1e-9)
    clipped = max(lo, min(hi, b))
    if mode is Rounding.CARRY:
        # Clipping is not an error to carry forward: only the rounding residue is diffused.
        carry = min(1.0, max(-1.0, real_bits + carry - clipped))
    return clipped, carry


@dataclass(frozen=True)
class GradStats:
    """What the server knows about the aggregated gradient G of the step just finished."""

    step: int                 # n: the step G belongs to; the policy picks B_{n+1}
    norm: float               # ‖G‖_p with the method's p (∞ by default, DQSGD App. F)
    rms: float                # ‖G‖₂ / √d
    spent_bits: int           # bits one worker really sent at step n (max over workers; from the ledger)
    grad: torch.Tensor | None = None  # G itself (AdaQS keeps moments of it); None if not needed
    down_bits: int | None = None  # of spent_bits, the downlink's real bits (a coded downlink under a
                                  # both-leg budget); None: the downlink is counted at its fixed size


def grad_norms(g: torch.Tensor, p: float) -> torch.Tensor:
    """``[‖g‖_p, ‖g‖₂]`` of a flat float32 vector, as a tensor on its device (the DDP hook reads it a
    step late, without waiting for the device). ‖g‖_∞ is max(−min g, max g): exactly max |g_i|
    (NaN if some g_i is), from one pass that allocates nothing (``g.abs().amax()`` writes a copy of g
    first: 7x slower on a 1.8M-element bucket)."""
    if math.isinf(p):
        lo, hi = torch.aminmax(g)
        norm = torch.maximum(-lo, hi)
    else:
        norm = torch.linalg.vector_norm(g, p)
    return torch.stack([norm, torch.linalg.vector_norm(g, 2)])


Spent = int | tuple[int, int]  # a step's spent bits, or (spent bits, of which the downlink's real bits)


def split_spent(spent: Spent) -> tuple[int, int | None]:
    """(spent bits, the downlink's real bits or None) of a :data:`Spent`."""
    if isinstance(spent, (tuple, list)):
        return int(spent[0]), int(spent[1])
    return int(spent), None


def stats_of(step: int, norm: float, l2: float, numel: int, spent_bits: Spent, g: torch.Tensor | None) -> GradStats:
    """The policy's statistics from :func:`grad_norms`' values (rms = ‖G‖₂/√d); ``spent_bits``: an
    int, or (bits, the coded downlink's bits among them)."""
    total, down = split_spent(spent_bits)
    return GradStats(step, norm, l2 / math.sqrt(numel), total, g, down)


def grad_stats(grad: torch.Tensor, step: int, spent_bits: Spent, p: float = math.inf, keep: bool = False) -> GradStats:
    g = grad.detach().reshape(-1).to(torch.float32)
    total, down = split_spent(spent_bits)
    if g.numel() == 0:
        return GradStats(step, 0.0, 0.0, total, g if keep else None, down)
    norm, l2 = grad_norms(g, p).tolist()
    rms = stats_of(step, norm, l2, g.numel(), spent_bits, None).rms
    if not (math.isfinite(norm) and math.isfinite(rms)):
        from dqsgd.quantizers import NonFiniteGradientError

        raise NonFiniteGradientError(f"aggregated gradient of step {step} is not finite (norm {norm})")
    return GradStats(step, norm, rms, total, g if keep else None, down)


S = TypeVar("S")


class PolicyState(Protocol):
    """What every policy's state has: ``bits``, the width of the next step."""

    @property
    def bits(self) -> int: ...


class BitPolicy(Protocol[S]):
    """init() -> state with .bits = B_0; update(state, stats) -> state with .bits = B_{n+1}."""

    name: str
    needs_grad: bool

    def init(self) -> S: ...

    def update(self, state: S, stats: GradStats) -> S: ...


def state_to_dict(state: Any) -> dict[str, Any]:
    """A policy state as a dict of numbers/tensors (safe for torch.load(weights_only=True))."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


def state_from_dict(cls: type[S], d: dict[str, Any]) -> S:
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if set(d) != names:
        raise ValueError(f"policy state for {cls.__name__}: expected fields {sorted(names)}, got {sorted(d)}")
    return cls(**d)
