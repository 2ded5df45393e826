"""The quantizer registry: every scheme by name, with what the layers above need to know about it.

``QUANTIZERS[name]`` is a :class:`Quantizer`. The method registry (``dqsgd.method.config``: which schemes
a method may use, their nominal widths, the checks of a configuration), ``pipeline.Method``
(quantize, scaler sharing, the width and scheme an uplink message must have) and ``dqsgd.encode``
(the ``scheme=`` names) read it instead of testing scheme names.

Adding a scheme: its module in this package (the quantizer and a :class:`~dqsgd.quantizers.base.SchemeQuantizer`
entry) and one line in ``QUANTIZERS``. A new wire format is not needed (``Quantized`` carries every
scheme); a new wire ``Scheme`` id is, if its codes mean something new.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme
from dqsgd.quantizers.identity import IDENTITY
from dqsgd.quantizers.lowprec import LOWPREC
from dqsgd.quantizers.sign import SCALED_SIGN, SIGN
from dqsgd.quantizers.sketch import SKETCH
from dqsgd.quantizers.sparse import RANDK, TOPK
from dqsgd.quantizers.ternary import TERNARY
from dqsgd.quantizers.uniform import UNIFORM

__all__ = ["QUANTIZERS", "Quantizer", "method_schemes", "quantizer"]


class Quantizer(Protocol):
    """One scheme as the layers above see it.

    Attributes:
      name: its name in method configs and in ``dqsgd.encode(scheme=...)``.
      scheme: the wire :class:`Scheme` of its messages.
      dynamic: its width may change every step (a bit policy chooses it); otherwise every message
        has :meth:`nominal_bits` and a method's policy must be ``"fixed"``.
      method: a method may use it (``MethodConfig.scheme``); others are for ``dqsgd.encode`` only.
      shares_scalers: workers max-reduce :meth:`scalers` before quantizing (TernGrad).
      fused: the fused CPU kernels (``dqsgd.kernels``, a method's ``kernel = "fused"``) implement it.
      segment_scales: its messages carry one scale per segment of the layout (identity: none).
    """

    name: str
    scheme: Scheme
    dynamic: bool
    method: bool
    shares_scalers: bool
    fused: bool
    segment_scales: bool

    def nominal_bits(self, bits: int) -> int:
        """The width of its messages for a configured width ``bits`` (B_0 of a dynamic scheme)."""
        ...

    def bits_error(self, bits: int) -> str | None:
        """Why ``bits`` is not a width a method may configure, or None."""
        ...

    def scalers(self, x: torch.Tensor, *, layout: Layout = ..., clip: float = ...) -> torch.Tensor:
        """This worker's candidate scalers, one per segment (schemes that share scalers only)."""
        ...

    def quantize(self, x: torch.Tensor, bits: int, generator: torch.Generator | None = None, *,
                 layout: Layout = ..., norm: Norm = ..., scaled: bool = ..., scalers: torch.Tensor | None = ...,
                 clip: float | None = ...) -> Quantized:
        """``x`` at width ``bits`` with uniforms from ``generator``. Options a scheme does not use are
        ignored: ``norm`` (uniform), ``scaled`` (sign: the l1-mean scale), ``scalers`` and ``clip``
        (ternary: the shared scalers, else this tensor's own with clip factor ``clip``; None: the
        scheme's default)."""
        ...


QUANTIZERS: dict[str, Quantizer] = {q.name: q for q in (
    IDENTITY,
    UNIFORM,
    SIGN,
    SCALED_SIGN,
    TERNARY,
    LOWPREC,
    SKETCH,
    TOPK,
    RANDK,
)}


def quantizer(name: str) -> Quantizer:
    """The registered scheme ``name``; an unknown name raises ``ValueError`` listing the known ones."""
    q = QUANTIZERS.get(name) if isinstance(name, str) else None
    if q is None:
        *rest, last = QUANTIZERS
        raise ValueError(f"unknown scheme {name!r}; use {', '.join(rest)} or {last}")
    return q


def method_schemes() -> tuple[str, ...]:
    """The schemes a method may use, in registry order."""
    return tuple(name for name, q in QUANTIZERS.items() if q.method)
