"""Fixed-width bit packing in torch ops (any device): the stream format of ``dqsgd.codecs.bitpack``.

Value i occupies stream bits ``[i·w, (i+1)·w)``, least significant first; stream bit j is bit
j mod 8 of byte ⌊j/8⌋; the stream has ⌈count·w/8⌉ bytes and zero padding bits. Eight values of
width w fill exactly w bytes, so the tensor is cut into groups of eight (the last one padded with
zero values, which are zero bits). A group's 8·w ≤ 128 bits do not fit one int64, so each group
is held as two halves of 4·w ≤ 64 bits: ``lo`` = values 0..3, ``hi`` = values 4..7. Byte b of the
group is stream bits [8b, 8b+8): it comes from ``lo``, from ``hi`` (shifted by 8b − 4w), or, for
an odd w, from both. Every shift is a Python constant, so under ``torch.compile`` each width
becomes straight-line code. Widths up to 7 use int32 (4·w ≤ 28 bits), wider ones int64.
"""

from __future__ import annotations

import torch

__all__ = ["pack_device", "padding_bits", "unpack_device"]


def _int_type(width: int) -> torch.dtype:
    return torch.int32 if width <= 7 else torch.int64


def _groups(t: torch.Tensor, per_group: int) -> torch.Tensor:
    """``t`` padded at the end with zeros to whole groups, as (groups, per_group)."""
    pad = -t.numel() % per_group
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    return t.view(-1, per_group)


def pack_device(values: torch.Tensor, width: int) -> torch.Tensor:
    """The packed stream (uint8, on ``values.device``) of non-negative integers ``values`` < 2^width.

    Values are not range-checked (callers produce them in range by construction): bits above
    ``width`` would leak into the neighbouring fields.
    """
    if not 1 <= width <= 16:
        raise ValueError(f"device packing handles widths 1..16, got {width}")
    n = values.numel()
    u = _groups(values.reshape(-1).to(_int_type(width)), 8)
    lo = u[:, 0]
    hi = u[:, 4]
    for k in range(1, 4):
        lo = lo | (u[:, k] << (k * width))
        hi = hi | (u[:, 4 + k] << (k * width))
    half = 4 * width
    out = []
    for b in range(width):
        d = 8 * b - half  # where byte b starts, relative to the start of hi
        part = (lo >> (8 * b)) if d < 0 else hi >> d
        if -8 < d < 0:  # the byte straddles lo and hi
            part = part | (hi << -d)
        out.append(part & 0xFF)
    return torch.stack(out, dim=1).reshape(-1)[: (n * width + 7) // 8].to(torch.uint8)


def unpack_device(stream: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The ``count`` values (int32 for width ≤ 7, else int64) of a packed uint8 stream of at least
    ⌈count·w/8⌉ bytes. Padding bits are not checked here (see ``padding_bits``)."""
    if not 1 <= width <= 16:
        raise ValueError(f"device packing handles widths 1..16, got {width}")
    half = 4 * width
    g = _groups(stream[: (count * width + 7) // 8], width).to(_int_type(width))
    lo = torch.zeros_like(g[:, 0])
    hi = torch.zeros_like(g[:, 0])
    for b in range(width):
        d = 8 * b - half
        if d < 0:
            lo = lo | (g[:, b] << (8 * b))
        if d > -8:
            hi = hi | ((g[:, b] << d) if d >= 0 else (g[:, b] >> -d))
    mask = (1 << width) - 1
    vals = [(lo >> (k * width)) & mask for k in range(4)] + [(hi >> (k * width)) & mask for k in range(4)]
    return torch.stack(vals, dim=1).reshape(-1)[:count]


def padding_bits(stream: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The bits above ``count·width`` in the stream's last byte, as a 0-dim int tensor (0 if valid)."""
    tail = (count * width) % 8
    if not tail or stream.numel() == 0:
        return torch.zeros((), dtype=torch.int32, device=stream.device)
    return (stream[-1].to(torch.int32) >> tail).reshape(())
