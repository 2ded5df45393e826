"""Small shared helpers for the quantizers: input checks and per-segment reductions."""

from __future__ import annotations

import torch

from dqsgd.quantizers.base import Layout


F32_MAX = float(torch.finfo(torch.float32).max)


class NonFiniteGradientError(ValueError):
    """A gradient (or model) tensor contains NaN or Inf; nothing was quantized or sent."""


def flat_float(x: torch.Tensor) -> torch.Tensor:
    """The tensor as a contiguous 1-D float32 view (a copy only when it must be)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.is_complex() or not (x.is_floating_point()):
        raise TypeError(f"expected a real floating-point tensor, got dtype {x.dtype}")
    flat = x.detach().reshape(-1)
    if flat.dtype == torch.float64 and flat.numel():  # values finite in fp64 may not be in fp32 (the wire's type)
        big = flat.abs().amax()
        if bool(torch.isfinite(big)) and float(big) > F32_MAX:
            raise ValueError(f"input has finite values up to {float(big):.3e}, beyond the float32 range "
                             f"(±{F32_MAX:.3e}) the payload carries; rescale the input")
    return flat.to(torch.float32)


def check_bits(bits: int, lo: int, hi: int, what: str) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{what}: bits must be an int, got {bits!r}")
    if not lo <= bits <= hi:
        raise ValueError(f"{what}: bits must be in [{lo}, {hi}], got {bits}")
    return bits


def require_finite(scales: torch.Tensor, what: str) -> None:
    """Scales are reductions of the whole input, so NaN/Inf anywhere shows up here for free."""
    if scales.numel() and not bool(torch.isfinite(scales).all()):
        raise NonFiniteGradientError(
            f"{what}: input contains NaN or Inf (non-finite norm {scales.tolist()[:4]}); refusing to quantize"
        )


def segment_reduce(flat: torch.Tensor, layout: Layout, op: str) -> torch.Tensor:
    """Per-segment 'max_abs' | 'l2' | 'l1_mean' | 'std' of a flat tensor (float32).

    Sums of squares (or of |x|) of finite float32 inputs can overflow float32 although the norm
    itself is representable (‖x‖₂ of 1e20s: Σx² = 1e40 > 3.4e38). Such a result is recomputed in
    float64; a norm that really exceeds the float32 range is refused as such, so "NaN or Inf" is
    only ever said of inputs that hold NaN or Inf.
    """
    out = _segment_reduce(flat, layout, op)
    if op == "max_abs" or not out.numel() or bool(torch.isfinite(out).all()) or not bool(torch.isfinite(flat).all()):
        return out
    wide = _segment_reduce(flat.to(torch.float64), layout, op)
    if float(wide.amax()) > F32_MAX:
        raise ValueError(f"the {op} norm {float(wide.amax()):.3e} of a finite input exceeds the float32 range "
                         f"(±{F32_MAX:.3e}) of the payload's scales; rescale the input")
    return wide.to(torch.float32)


def _segment_reduce(flat: torch.Tensor, layout: Layout, op: str) -> torch.Tensor:
    n = flat.numel()
    sizes = layout.segment_sizes(n)
    if not sizes:
        return torch.zeros(0, dtype=torch.float32, device=flat.device)
    if len(sizes) == 1:
        return _reduce(flat, op).reshape(1)
    if layout.sizes is None and sizes[-1] == sizes[0]:
        return _reduce(flat.view(len(sizes), sizes[0]), op, dim=1)
    zero = torch.zeros((), dtype=flat.dtype, device=flat.device)  # an empty segment reduces to 0
    return torch.stack([_reduce(part, op) if part.numel() else zero for part in torch.split(flat, sizes)])


def _reduce(v: torch.Tensor, op: str, dim: int | None = None) -> torch.Tensor:
    kw = {} if dim is None else {"dim": dim}
    if op == "max_abs":
        # abs().amax() is ~8x faster than vector_norm(inf) on CPU (measured; docs/design.md).
        return v.abs().amax(**kw)
    if op == "l2":
        return torch.linalg.vector_norm(v, 2, **kw)
    if op == "l1_mean":
        return v.abs().mean(**kw)
    if op == "std":
        return v.std(unbiased=False, **kw) if dim is not None else v.std(unbiased=False)
    raise ValueError(f"unknown reduction {op!r}")


def expand(per_segment: torch.Tensor, layout: Layout, numel: int) -> torch.Tensor:
    """Repeat one value per segment over that segment's coordinates."""
    sizes = layout.segment_sizes(numel)
    if len(sizes) <= 1:
        return per_segment.reshape(-1)[:1].expand(numel) if sizes else per_segment[:0]
    return torch.repeat_interleave(per_segment, torch.tensor(sizes, device=per_segment.device))
