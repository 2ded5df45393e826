"""Hypothesis strategies and helpers shared by the codec tests.

Codes are drawn from a seeded numpy generator (not element by element) so that examples stay
fast; Hypothesis still controls every size, width, layout, density and edge case.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from dqsgd.quantizers.base import RAW_SCHEMES, Layout, Norm, Quantized, Scheme

# No example database: the tests must not write outside tests/ and src/ (shared tree).
SETTINGS = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

INTEGER_SCHEMES = (Scheme.UNIFORM, Scheme.SIGN, Scheme.TERNARY, Scheme.LOWPREC)


def code_bounds(scheme: Scheme, bits: int, levels: int) -> tuple[int, int, bool]:
    """(lo, hi, zero allowed): the documented valid code set, restated independently of wire.py."""
    if bits == 1:
        lo, hi, zero = -1, 1, False
    else:
        lo, hi, zero = -(1 << (bits - 1)), (1 << (bits - 1)) - 1, True
    if scheme == Scheme.UNIFORM:
        lo, hi = max(lo, -levels), min(hi, levels)
    if scheme in (Scheme.SIGN, Scheme.TERNARY):
        lo, hi = max(lo, -1), min(hi, 1)
        zero = zero and scheme == Scheme.TERNARY
    return lo, hi, zero


@st.composite
def shapes(draw: st.DrawFn, max_numel: int = 300) -> tuple[int, ...]:
    dims = draw(st.lists(st.integers(0, 17), max_size=4))
    while math.prod(dims) > max_numel:
        dims[dims.index(max(dims))] //= 2
    return tuple(dims)


@st.composite
def layouts(draw: st.DrawFn, numel: int) -> Layout:
    kind = draw(st.sampled_from(["one", "bucket", "sizes"]))
    if kind == "one":
        return Layout()
    if kind == "bucket":
        return Layout(bucket=draw(st.integers(1, numel + 3)))
    cuts = sorted(draw(st.lists(st.integers(0, numel), max_size=6)))
    bounds = [0, *cuts, numel]
    return Layout(sizes=tuple(b - a for a, b in zip(bounds, bounds[1:])))


def random_codes(seed: int, numel: int, lo: int, hi: int, zero_ok: bool, density: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    codes = rng.integers(lo, hi + 1, numel, dtype=np.int64)
    codes[rng.random(numel) >= density] = 0
    if not zero_ok:
        codes[codes == 0] = np.where(rng.random(int((codes == 0).sum())) < 0.5, -1, 1)
    edge = rng.integers(0, max(numel, 1), 2)  # make the extremes likely to appear
    if numel:
        codes[edge[0]], codes[edge[1]] = lo, hi
    return codes.astype(np.int32)


def random_scales(seed: int, n: int) -> np.ndarray:
    """Finite float32 with awkward values: zero, -0.0, denormals, huge, negative."""
    rng = np.random.default_rng(seed + 1)
    special = np.array([0.0, -0.0, 1e-45, -3e38, 3.4e38, 1.0], dtype=np.float32)
    vals = (rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    pick = rng.random(n) < 0.3
    vals[pick] = special[rng.integers(0, special.size, int(pick.sum()))]
    return vals


@st.composite
def quantized(
    draw: st.DrawFn,
    schemes: tuple[Scheme, ...] = INTEGER_SCHEMES,
    bits: st.SearchStrategy[int] | None = None,
    max_numel: int = 300,
) -> Quantized:
    """A valid integer-scheme Quantized of any width 1..16, shape, layout and density."""
    scheme = draw(st.sampled_from(schemes))
    b = draw(bits if bits is not None else st.integers(1, 16))
    levels = draw(st.integers(1, max(1, (1 << (b - 1)) - 1))) if scheme == Scheme.UNIFORM else 1
    shape = draw(shapes(max_numel))
    numel = math.prod(shape)
    layout = draw(layouts(numel))
    lo, hi, zero_ok = code_bounds(scheme, b, levels)
    seed = draw(st.integers(0, 2**32 - 1))
    density = draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
    codes = random_codes(seed, numel, lo, hi, zero_ok, density)
    nseg = len(layout.segment_sizes(numel))
    norm = draw(st.sampled_from(list(Norm)))
    return Quantized(
        scheme, b, levels, torch.from_numpy(codes), torch.from_numpy(random_scales(seed, nseg)), layout, shape, norm
    )


@st.composite
def identity_quantized(draw: st.DrawFn, max_numel: int = 300) -> Quantized:
    """A raw float32 message: IDENTITY, or SKETCH (a count sketch's table; the same body)."""
    shape = draw(shapes(max_numel))
    scheme = draw(st.sampled_from(sorted(RAW_SCHEMES)))
    numel = math.prod(shape)
    seed = draw(st.integers(0, 2**32 - 1))
    values = random_scales(seed, numel)
    if numel and draw(st.booleans()):  # extreme but finite raw values (NaN/Inf are refused both ways)
        values[0] = np.float32(3.4e38)
    empty_i, empty_f = torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.float32)
    return Quantized(scheme, 32, 1, empty_i, empty_f, Layout(), shape, Norm.NONE, torch.from_numpy(values))


def assert_same(a: Quantized, b: Quantized) -> None:
    """Exact equality: codes, bit patterns of scales and values, and every header field."""
    assert (a.scheme, a.bits, a.levels, a.norm) == (b.scheme, b.bits, b.levels, b.norm)
    assert tuple(a.shape) == tuple(b.shape)
    assert a.codes.dtype == b.codes.dtype == torch.int32
    assert torch.equal(a.codes, b.codes)
    assert np.array_equal(a.scales.numpy().view(np.uint32), b.scales.numpy().view(np.uint32))
    if a.scheme in RAW_SCHEMES:
        assert np.array_equal(a.values.numpy().view(np.uint32), b.values.numpy().view(np.uint32))
    else:
        assert a.layout.segment_sizes(a.numel) == b.layout.segment_sizes(b.numel)
