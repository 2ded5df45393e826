"""The downlink of a run, resolved once from its configuration and carried as one frozen object.

The trainer (``train.downlink_*`` keys), the DDP hook (``HookState(downlink_*=...)``) and
``LocalSGDOptimizer`` each call :func:`downlink_of` once with their options; the step objects and the
bucket protocol take the resulting :class:`DownlinkSpec` as it is, and the hook's fingerprint, the
trainer's run record and their checkpoints read its :meth:`DownlinkSpec.fields`. Adding a downlink
option is a field here, its check in :func:`resolve_downlink` and its name in :data:`OPTIONS`, then the
surfaces that expose it (a ``[train]`` key, a ``HookState`` keyword) and the protocol's use of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from dqsgd.topology.downlink import resolve_downlink_coding
from dqsgd.topology.names import (
    AUTO, DOWNLINK_PARITY_BITS, FP32, check_downlink_bits, check_downlink_safety, check_downlink_target,
    resolve_downlink_bits)

if TYPE_CHECKING:
    from dqsgd.method.config import MethodConfig

SPELL = ("downlink_feedback=True", "allow_unsafe_downlink=True")  # how an option is written in an error
# the options, as the config keys and the keywords name them, and their values where one is not given
OPTIONS: dict[str, Any] = {"downlink_bits": None, "downlink_coding": None, "downlink_feedback": False,
                           "downlink_target_bits": 0.0, "allow_unsafe_downlink": False}


@dataclass(frozen=True)
class DownlinkSpec:
    """A resolved downlink: ``bits`` (2..16, :data:`FP32` or ``"auto"``: the policy picks each step's
    width), ``coding`` (a coding name; ``"fixed"`` wherever the downlink is not quantized), ``feedback``
    (the shard servers keep their rounding residual) and ``target_bits`` (under ``"auto"``: the
    downlink's share of the both-leg budget per coordinate and step; 0: an 8-bit fixed downlink's cost)."""

    bits: int | str = DOWNLINK_PARITY_BITS
    coding: str = "fixed"
    feedback: bool = False
    target_bits: float = 0.0

    def __post_init__(self) -> None:
        if self.bits != AUTO:
            check_downlink_bits(self.bits)
        check_downlink_target(self.target_bits, self.bits == AUTO)

    @property
    def auto(self) -> bool:
        return self.bits == AUTO

    def fields(self) -> dict[str, Any]:
        """The resolved downlink by option name: what a run records and the ranks and checkpoints compare."""
        return {"downlink_bits": self.bits, "downlink_feedback": self.feedback, "downlink_coding": self.coding,
                "downlink_target_bits": self.target_bits}


# the fields a state saved before they existed lacks, and what such a state ran (feedback off, a fixed downlink)
BEFORE: dict[str, Any] = {"downlink_feedback": False, "downlink_coding": "fixed", "downlink_target_bits": 0.0}


def resolve_downlink(bits: object = None, coding: object = None, feedback: bool = False, target_bits: float = 0.0,
                     allow_unsafe: bool = False, *, policy: str, uplink_coding: str, vote: bool, topology: str,
                     spell: tuple[str, str] = SPELL, where: str = "") -> DownlinkSpec:
    """The run's :class:`DownlinkSpec`: the width (None or 0: the method's default), its safety (a
    width below 4 bits needs ``feedback`` or ``allow_unsafe``), the coding (None: the uplink's for a
    quantized downlink) and the both-leg target, each checked once (ValueError naming the option;
    ``where``: the options' prefix in the caller's interface, e.g. ``"train."``; TypeError where a flag is
    not a bool)."""
    for name, flag in (("downlink_feedback", feedback), ("allow_unsafe_downlink", allow_unsafe)):
        if not isinstance(flag, bool):
            raise TypeError(f"{where}{name} must be True or False, got {flag!r}")
    try:
        width = resolve_downlink_bits(bits, policy=policy, topology=topology, vote=vote)
    except ValueError as e:
        raise ValueError(f"{where}downlink_bits: {e}" if where else str(e)) from None
    check_downlink_safety(width, feedback, allow_unsafe, topology=topology, vote=vote, spell=spell)
    try:
        chosen = resolve_downlink_coding(coding, uplink_coding=uplink_coding, bits=width, vote=vote, topology=topology)
    except ValueError as e:
        raise ValueError(f"{where}downlink_coding: {e}" if where else str(e)) from None
    try:
        target = check_downlink_target(target_bits, width == AUTO)
    except ValueError as e:
        raise ValueError(f"{where}downlink_target_bits: {e}" if where else str(e)) from None
    return DownlinkSpec(width, chosen, bool(feedback), target)


def downlink_of(options: Mapping[str, Any] | object, method: MethodConfig, topology: str, *,
                spell: tuple[str, str] = SPELL, where: str = "") -> DownlinkSpec:
    """The :class:`DownlinkSpec` of ``method`` on ``topology`` from a surface's options (:data:`OPTIONS`):
    a mapping of keyword options or an object holding them as attributes (a ``[train]`` config); an option
    it lacks takes its default. Every surface resolves its downlink here, once."""
    get = options.get if isinstance(options, Mapping) else (lambda k, d: getattr(options, k, d))
    bits, coding, feedback, target, unsafe = (get(k, d) for k, d in OPTIONS.items())
    return resolve_downlink(bits, coding, feedback, target, unsafe, policy=method.policy,
                            uplink_coding=method.coding, vote=method.aggregate == "majority", topology=topology,
                            spell=spell, where=where)


FP32_DOWNLINK = DownlinkSpec(FP32)  # the fp32 downlink (FSDP's reduce-scatter has no downlink of its own)
