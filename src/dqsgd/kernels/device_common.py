"""Shared parts of the device codec: which kernels run (Triton or torch ops), compilation switch,
segment indices, header templates.

See :mod:`dqsgd.kernels.device` for what the codec computes and why.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from dqsgd.codecs import Coding
from dqsgd.codecs import wire  # its validators, so both paths accept and refuse the same payloads
from dqsgd.codecs.bitpack import packed_size
from dqsgd.codecs.header import Header, parse_header, write_header
from dqsgd.quantizers import Layout, Norm, Scheme, levels_for_bits

__all__ = ["LazyBytes", "Template", "compiled_variants", "expected_header", "head_on", "kernel", "per_element",
           "seg_ids_of", "set_compile", "set_triton", "template", "triton_available", "use_triton"]


# ------------------------------------------------------------------------------ Triton or torch ops

_FORCE_TRITON: bool | None = None
_WARNED_NO_TRITON = False


def set_triton(mode: bool | None) -> None:
    """``True``: the n-sized passes of the FIXED uniform codec run as the Triton kernels of
    :mod:`dqsgd.kernels.triton_codec` on every device (CPU tensors need ``TRITON_INTERPRET=1`` set
    before Triton is first imported: the tests' way of running them without a GPU); ``False``: torch
    ops everywhere; ``None`` (default): Triton on CUDA where it is installed, torch ops elsewhere."""
    global _FORCE_TRITON
    _FORCE_TRITON = mode


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (the ``gpu`` extra)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device) -> bool:
    """Whether the codec on ``device`` runs the Triton kernels: the one place that decides.

    On CUDA without Triton it runs the torch-ops codec and says so once (a warning)."""
    global _WARNED_NO_TRITON
    if _FORCE_TRITON is not None:
        if _FORCE_TRITON and not triton_available():
            raise RuntimeError("set_triton(True), but the triton package is not installed (pip install 'dqsgd[gpu]')")
        return _FORCE_TRITON
    if device.type != "cuda":
        return False
    if triton_available():
        return True
    if not _WARNED_NO_TRITON:
        _WARNED_NO_TRITON = True
        warnings.warn("Triton is not installed: the CUDA codec runs as torch ops under torch.compile instead of the "
                      "Triton kernels (same bytes, slower); pip install 'dqsgd[gpu]'", RuntimeWarning, stacklevel=3)
    return False


# ------------------------------------------------------------------------------ compilation

_FORCE_COMPILE: bool | None = None
_COMPILED: dict[Callable, Callable] = {}


def set_compile(mode: bool | None) -> None:
    """``True``: run the hot kernels under ``torch.compile`` on every device; ``False``: eager
    everywhere; ``None`` (default): compiled on CUDA, eager elsewhere."""
    global _FORCE_COMPILE
    _FORCE_COMPILE = mode


def kernel(fn: Callable, device: torch.device) -> Callable:
    """``fn`` itself, or its compiled form (one per function; dynamo caches one graph per shape)."""
    use = _FORCE_COMPILE if _FORCE_COMPILE is not None else device.type == "cuda"
    if not use:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


# ------------------------------------------------------------------------------ segments

_SEG_IDS: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}


def seg_ids_of(layout: Layout, device: torch.device) -> torch.Tensor | None:
    """Segment index of every coordinate, for explicit sizes (None otherwise: computed inline)."""
    if layout.sizes is None:
        return None
    key = (tuple(layout.sizes), str(device))
    if key not in _SEG_IDS:
        if len(_SEG_IDS) > 64:
            _SEG_IDS.clear()
        sizes = torch.tensor(layout.sizes, dtype=torch.int64)
        _SEG_IDS[key] = torch.repeat_interleave(torch.arange(len(layout.sizes)), sizes).to(device)
    return _SEG_IDS[key]


def per_element(vals: torch.Tensor, seg_ids: torch.Tensor | None, bucket: int, n: int) -> torch.Tensor:
    """The per-segment ``vals`` at each of the n coordinates (broadcast for one segment)."""
    if seg_ids is not None:
        return vals[seg_ids]
    if bucket and vals.numel() > 1:
        return vals[torch.arange(n, device=vals.device) // bucket]
    return vals


# ------------------------------------------------------------------------------ header template


@dataclass(frozen=True)
class Template:
    head: bytes  # header bytes (body length included) with zero scales
    scale_at: int  # offset of the nseg float32 scales
    nseg: int
    body_len: int
    header: Header


class LazyBytes:
    """A read-only byte sequence of a given length whose slices are fetched on demand: lets
    ``parse_header`` (which needs the payload's total length) read a header without the body."""

    def __init__(self, length: int, fetch: Callable[[int, int], bytes]) -> None:
        self.length, self.fetch = length, fetch

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, s: slice) -> bytes:
        lo, hi, _ = s.indices(self.length)
        return self.fetch(lo, max(lo, hi))


_TEMPLATES: dict[tuple, Template] = {}


def template(shape: tuple[int, ...], bits: int, norm: Norm, layout: Layout,
             dtype: torch.dtype = torch.float32) -> Template:
    key = (shape, bits, int(norm), layout, dtype)
    if key in _TEMPLATES:
        return _TEMPLATES[key]
    n = math.prod(shape)
    nseg = wire.check_layout(layout, n)
    body_len = packed_size(n, bits)

    def head(fill: np.ndarray) -> bytes:
        return write_header(Scheme.UNIFORM, bits, Coding.FIXED, norm, levels_for_bits(bits), shape, layout, fill,
                            body_len, dtype=dtype)

    h0, h1 = head(np.zeros(nseg, np.float32)), head(np.full(nseg, 0xFFFFFFFF, np.uint32).view(np.float32))
    diff = np.flatnonzero(np.frombuffer(h0, np.uint8) != np.frombuffer(h1, np.uint8))
    at = int(diff[0]) if diff.size else len(h0)
    if len(h0) != len(h1) or diff.size != 4 * nseg or (diff.size and int(diff[-1]) != at + 4 * nseg - 1):
        raise AssertionError("write_header does not store the scales as one run of float32 bytes")
    total = len(h0) + body_len + 4
    header = parse_header(LazyBytes(total, lambda lo, hi: h0[lo:hi] + bytes(max(0, hi - max(lo, len(h0))))),
                          max_numel=max(n, 1))
    if len(_TEMPLATES) > 256:
        _TEMPLATES.clear()
    _TEMPLATES[key] = Template(h0, at, nseg, body_len, header)
    return _TEMPLATES[key]


_HEADS: dict[tuple[bytes, str], tuple[torch.Tensor, torch.Tensor]] = {}


def head_on(tpl: Template, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the template's header bytes, a mask that is False on the scales) as device tensors, copied
    once per device: a copy from pageable host memory would wait for the device on every call."""
    key = (tpl.head, str(device))
    if key not in _HEADS:
        if len(_HEADS) > 256:
            _HEADS.clear()
        care = np.ones(len(tpl.head), dtype=bool)
        care[tpl.scale_at : tpl.scale_at + 4 * tpl.nseg] = False
        _HEADS[key] = (torch.from_numpy(np.frombuffer(tpl.head, np.uint8).copy()).to(device),
                       torch.from_numpy(care).to(device))
    return _HEADS[key]


def expected_header(shape: tuple[int, ...], bits: int, *, norm: Norm = Norm.MAX, layout: Layout = Layout(),
                    dtype: torch.dtype = torch.float32) -> Header:
    """The header of an :func:`encode_uniform_device` payload of this shape, with zero placeholder
    scales: pass it as ``header=`` to :func:`decode_accumulate_device` to decode with no sync."""
    return template(tuple(int(d) for d in shape), bits, Norm(norm), layout, dtype).header


# ------------------------------------------------------------------------------ compiled variants

_TRITON_MODULES = ("dqsgd.kernels.triton_codec", "dqsgd.kernels.triton_decode", "dqsgd.kernels.triton_crc",
                   "dqsgd.kernels.triton_batch")


def compiled_variants() -> dict[str, int | None]:
    """What has been compiled so far in this process, as counters (a difference over a span of work is
    its recompilations): ``triton``, the variants in the JIT caches of every Triton kernel of the codec
    (None under Triton's interpreter, which compiles nothing); ``torch.compile``, dynamo's graphs."""
    import sys

    kernels = [k for name in _TRITON_MODULES if name in sys.modules
               for k in vars(sys.modules[name]).values() if type(k).__name__ in ("JITFunction", "InterpretedFunction")]
    jit = [k for k in kernels if type(k).__name__ == "JITFunction"]
    triton = None if len(jit) < len(kernels) else sum(len(c[0]) for k in jit for c in k.device_caches.values())
    dynamo = sys.modules.get("torch._dynamo")
    graphs = int(dynamo.utils.counters["stats"]["unique_graphs"]) if dynamo is not None else 0
    return {"triton": triton, "torch.compile": graphs}
