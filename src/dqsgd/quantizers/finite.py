"""One finite-output rule for every decoder: a payload whose values would not be finite in the
output's dtype is refused before anything of it is added to the output.

A decoder adds ``v_i = w·(c_i·step_k)`` in float32 (``step_k = scale_k / levels``, as
:func:`dqsgd.quantizers.dequantize` computes it; raw schemes: ``v_i = w·x_i``), where ``w`` is the
caller's weight (1 for a plain decode). The rule: every ``v_i`` must be finite and at most the output
dtype's largest value (:func:`dtype_limit`: float32's for an accumulator, 65504 for a float16 result),
else the payload is refused (``PayloadError`` in the codecs and kernels, ``ValueError`` from
``dequantize``) and the output is as it was. Finite scales are not enough: a forged scale of 1e5 in a
float16 payload, or one near float32's top times the top code, is finite and decodes to ±inf.

Every decoder checks it with the functions here, in one of two forms, by where the values land:

* **added in place** into a float32 output (``decode_accumulate``, ``FixedPlan.accumulate``,
  ``decode_accumulate_device`` with its torch ops and Triton kernels, ``decode_into`` on a float32
  tensor): from the scales alone, before the body is read. :func:`step_bound` is the largest
  ``|v|`` a segment's scale can give at the scheme's top code, computed with the decoders' own
  float32 operations (rounding is monotone, so no decoded value exceeds it); it must be finite. For a
  max-norm payload it is exactly the largest decoded value (the segment's largest entry has the top
  code); an l2 scale within a few float32 ulps of float32's max whose codes stay below the top is
  refused too. Raw values (IDENTITY, SKETCH) are read from the body: their largest magnitude, NaN
  included (the host decoder's two passes over the body, nothing allocated).
* **narrowed** to float16/bfloat16 from a fresh float32 buffer (``decode``, ``decode_device``,
  ``decode_into`` on such a tensor, ``dequantize``): the values themselves (:func:`overflow` of their
  largest magnitude) once they are in the buffer, before it is narrowed, returned or added. Exact: a
  float16 l2 payload whose scale exceeds 65504 while every value fits is decoded.

On a device nothing is read to the host per payload for the in-place form, and nothing is launched
for it on the Triton path: the decode kernel's check pass computes the same bound from each
coordinate's step and sets its own flag (a segment with no coordinate decodes nothing and is not
looked at, on any path). The torch-ops decoder turns the bound into a device flag with :func:`beyond`
where the steps already are. Either flag is read with the other checks' flags in the one sync
``check="sync"`` makes anyway, or ORed into the caller's ``bad`` flag by ``check="defer"``.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

__all__ = ["beyond", "dtype_limit", "narrows", "overflow", "step_bound"]

A = TypeVar("A", np.ndarray, torch.Tensor)


def dtype_limit(dtype: torch.dtype) -> float:
    """The largest magnitude a decoded value may have: it must fit float32 (the arithmetic) and the
    output's dtype (float16: 65504; bfloat16: 3.39e38), else it would round to ±inf."""
    return min(torch.finfo(torch.float32).max, torch.finfo(dtype).max)


def narrows(dtype: torch.dtype) -> bool:
    """Whether a float32 value may not fit ``dtype`` (float16, bfloat16): the narrowed form applies."""
    return dtype_limit(dtype) < torch.finfo(torch.float32).max


def step_bound(steps: A, top: int, weight: float) -> A:
    """Per segment, ``|w·(top·step)|`` in float32: the largest magnitude a decoder's float32
    ``w·(c·step)`` reaches for codes |c| ≤ ``top`` (float32 ``steps``: a numpy array on the host,
    a tensor where the decoder's steps are)."""
    if isinstance(steps, torch.Tensor):
        w = torch.full((), weight, dtype=torch.float32, device=steps.device)
        return (w * (torch.full((), float(top), dtype=torch.float32, device=steps.device) * steps)).abs()
    with np.errstate(over="ignore", invalid="ignore"):
        return np.abs(np.float32(weight) * (np.float32(top) * steps.astype(np.float32, copy=False)))


def overflow(peak: float, dtype: torch.dtype, what: str) -> str | None:
    """Why values of largest magnitude ``peak`` (NaN: some value is NaN) break the rule for a
    ``dtype`` output, or None when they fit; ``what`` names the payload."""
    if peak <= dtype_limit(dtype):
        return None
    name = str(dtype).removeprefix("torch.")
    return (f"{what} decodes to values beyond {name} or not finite (|w·x| up to {peak:.3e}: a forged scale?); "
            f"refused before anything was added")


def beyond(peak: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`overflow` as a 0-dim bool flag on ``peak``'s device (no sync): True where the largest
    of ``peak`` (NaN included) breaks the rule for a ``dtype`` output."""
    top = peak.amax() if peak.numel() else torch.zeros((), dtype=peak.dtype, device=peak.device)
    return ~(top <= dtype_limit(dtype))
