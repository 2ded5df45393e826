"""The FIXED uniform codec batched over payloads: every shard of a bucket in one call.

A bucket cut into S shards sends S payloads per rank (one per shard server) and a shard server adds
W payloads (one per rank); the downlink decodes S payloads (one per shard). Coding them one call at a
time costs the per-call host work S or W times. Here one call does them all:

* :meth:`Batch.encode` — the S shards of one flat vector into **one** ``uint8`` buffer (one
  allocation): payload j at ``offsets[j]``, ``sizes[j]`` bytes, each followed by ``gap`` free bytes
  (the hook's flag byte);
* :meth:`Batch.accumulate` — P payloads lying in one buffer at ``offsets`` added into slices of one
  float32 vector (``out[out_at[p] :][: numel_p] += w·x̂_p``), in payload order: the W payloads of a
  shard (all at the same slice) or the S shards of a downlink (each at its own).

The bytes and the sums are those of the one-payload codec (:class:`dqsgd.kernels.codec.FixedPlan` on
the CPU, :mod:`dqsgd.kernels.device` elsewhere) bit for bit: the CPU batch runs the same compiled
loops over the payloads inside one call (:mod:`dqsgd.kernels.fused_batch`), the Triton batch
(:mod:`dqsgd.kernels.triton_batch`) launches each pass once for all payloads, a grid over payloads ×
blocks. What one call issues is in ``docs/gpu-codec.md`` ("Batched over shards").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from dqsgd.codecs.threads import crc32, run_split
from dqsgd.kernels import fused
from dqsgd.kernels.codec import MIN_CHUNKS_PER_THREAD, FixedPlan, max_norms, fixed_plan, inverse_norms
from dqsgd.kernels.fused_batch import accumulate_many_range, encode_many_range
from dqsgd.quantizers import Layout, Norm, Scheme
from dqsgd.codecs.header import top_code
from dqsgd.quantizers.base import step_bound

__all__ = ["Batch", "decode_batch", "encode_batch"]

Spec = tuple[tuple[int, Layout], ...]  # (numel, layout) of each payload


def _cum(values: Sequence[int]) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(np.asarray(values, dtype=np.int64)))).astype(np.int64)


@dataclass(frozen=True, eq=False)
class Batch:
    """P FIXED uniform payloads at ``bits`` and ``norm``, payload p of ``spec[p] = (numel, layout)``,
    lying at ``offsets[p]`` of one buffer of ``total`` bytes and added at ``out_at[p]`` of one vector."""

    spec: Spec
    bits: int
    norm: Norm
    offsets: tuple[int, ...]
    out_at: tuple[int, ...]
    total: int

    @functools.cached_property
    def plans(self) -> list[FixedPlan]:
        return [fixed_plan(n, self.bits, self.norm, lay) for n, lay in self.spec]

    @property
    def sizes(self) -> list[int]:
        return [p.size for p in self.plans]

    @functools.cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        """The per-payload tables the compiled loops and the checks read, built once per batch."""
        plans, at = self.plans, np.asarray(self.offsets, dtype=np.int64)
        heads = np.asarray([p.head_len for p in plans], dtype=np.int64)
        fixed = [np.r_[0 : p.scales_at, p.head_len - 4 : p.head_len] for p in plans]
        scales = [np.arange(p.scales_at, p.head_len - 4) for p in plans]
        size = np.asarray([p.size for p in plans], dtype=np.int64)
        tails = np.asarray([(p.numel * p.bits) % 8 for p in plans], dtype=np.int64)
        return {
            "numels": np.asarray([p.numel for p in plans], dtype=np.int64),
            "starts": np.concatenate([p.starts for p in plans]), "starts_at": _cum([p.starts.size for p in plans]),
            "seg_at": _cum([p.starts.size - 1 for p in plans]),
            "body_at": at + heads, "body_len": np.asarray([p.body_len for p in plans], dtype=np.int64),
            "fixed_idx": np.concatenate([a + f for a, f in zip(at, fixed)]),
            "fixed_bytes": np.concatenate([p.template[f] for p, f in zip(plans, fixed)]),
            "scale_idx": np.concatenate([a + s for a, s in zip(at, scales)]),
            "out_at": np.asarray(self.out_at, dtype=np.int64), "at": at, "size": size,
            "last": at + heads + np.maximum(np.asarray([p.body_len for p in plans]) - 1, 0), "tail": tails,
            "global_starts": np.concatenate([p.starts[:-1] + o for p, o in zip(plans, self.out_at)]
                                            + [np.asarray([self.out_at[-1] + plans[-1].numel])]),
        }

    # ------------------------------------------------------------------------------ encode

    def encode(self, flat: torch.Tensor, keys: Sequence[int]) -> torch.Tensor:
        """Every payload of the contiguous shards of ``flat`` (shard p = ``flat[out_at[p] :][: numel_p]``)
        with HashRNG keys ``keys`` (unsigned), in one ``uint8`` buffer of :attr:`total` bytes on
        ``flat``'s device; the bytes between payloads are 0. The numba kernels (a float32 CPU input);
        on a GPU, :func:`dqsgd.kernels.triton_batch.encode_batch_triton` of this batch writes the same
        bytes (its checks are deferred: a non-finite shard or a too small norm writes a NaN scale,
        which every decoder refuses).

        Raises (CPU):
          NonFiniteGradientError, ValueError: as :meth:`FixedPlan.encode_into` of the first shard that
            refuses; the exception's ``shard`` attribute is its index.
        """
        a = self.arrays
        x = flat.detach().reshape(-1).contiguous()
        if x.dtype != torch.float32 or x.numel() != int(a["numels"].sum()):
            raise ValueError(f"flat must be a float32 vector of {int(a['numels'].sum())} elements, "
                             f"got {x.dtype} {tuple(flat.shape)}")
        scales = self._scales(x)
        inv = self._inverse(scales)
        buf = np.zeros(self.total, dtype=np.uint8)
        buf[a["fixed_idx"]] = a["fixed_bytes"]
        buf[a["scale_idx"]] = scales.view(np.uint8)
        args = (x.numpy(), a["numels"], a["starts"], a["starts_at"], inv, a["seg_at"],
                np.float32(self.plans[0].levels), self.bits == 1,
                np.asarray([k & 0xFFFFFFFFFFFFFFFF for k in keys], dtype=np.uint64), self.bits,
                0 if self.bits == 1 else 1 << (self.bits - 1), buf, a["body_at"], a["body_len"])
        self._run(encode_many_range, args)
        for at, size in zip(self.offsets, self.sizes):
            buf[at + size - 4 : at + size] = np.array([crc32(buf[at : at + size - 4])], dtype="<u4").view(np.uint8)
        return torch.from_numpy(buf)

    def _scales(self, x: torch.Tensor) -> np.ndarray:
        """Every segment's norm, shards in order: one pass of the max norm over the whole vector."""
        if self.norm == Norm.MAX and x.numel():
            return max_norms(x, self.arrays["global_starts"])
        return np.concatenate([p._scales(x[o : o + p.numel]) for p, o in zip(self.plans, self.out_at)])

    def _inverse(self, scales: np.ndarray) -> np.ndarray:
        try:
            return inverse_norms(scales, self.plans[0].levels)
        except (ValueError, ArithmeticError):  # name the shard: refused again with its own norms only
            seg = self.arrays["seg_at"]
            for j in range(len(self.plans)):
                try:
                    inverse_norms(scales[seg[j] : seg[j + 1]], self.plans[j].levels)
                except (ValueError, ArithmeticError) as e:
                    e.shard = j  # type: ignore[attr-defined]
                    raise
            raise

    def _run(self, fn, args: tuple):  # noqa: ANN001, ANN202 - a compiled loop and its arguments
        chunks = -(-int(self.arrays["numels"].max()) // fused.CHUNK)
        if chunks < 2 * MIN_CHUNKS_PER_THREAD:
            return [fn(*args, 0, chunks)]
        return run_split(fn, chunks, *args, min_per_thread=MIN_CHUNKS_PER_THREAD)

    # ------------------------------------------------------------------------------ decode

    def accumulate(self, buf: torch.Tensor, out: torch.Tensor, weight: float = 1.0) -> int | None:
        """``out[out_at[p] :][: numel_p] += weight·x̂_p`` for every payload p of ``buf`` (a 1-D
        ``uint8`` tensor of at least :attr:`total` bytes), in payload order, each validated as
        :meth:`FixedPlan.accumulate` validates it.

        The numba kernels (CPU tensors): returns None, or the index of the first payload that fails
        a check; its checks but the code range are made before anything is added (the code range
        while adding: ``out`` then holds a partial sum). The caller refuses it
        (:meth:`FixedPlan.accumulate` says why).
        On a GPU, :func:`dqsgd.kernels.triton_batch.accumulate_batch_triton` of this batch adds the
        same sums; every failed check sets its ``bad`` (a 0-dim bool on the device), no sync.
        """
        a, arr = self.arrays, buf.numpy()
        if out.dtype != torch.float32 or out.numel() < int((a["out_at"] + a["numels"]).max()):
            raise ValueError(f"out must be a float32 tensor of {int((a['out_at'] + a['numels']).max())} elements, "
                             f"got {out.dtype} {tuple(out.shape)}")
        first = self._first_bad(arr)
        if first is not None:
            return first
        scales = arr[a["scale_idx"]].view("<f4").astype(np.float32)
        steps = scales / np.float32(self.plans[0].levels)  # float32 division, FixedPlan.accumulate's floats
        beyond = self._first_beyond(steps, weight)
        if beyond is not None:  # the finite-output rule, before anything is added
            return beyond
        o = out.reshape(-1).numpy()
        args = (arr, a["body_at"], a["body_len"], self.bits, 0 if self.bits == 1 else 1 << (self.bits - 1),
                self.bits == 1, a["numels"], a["starts"], a["starts_at"], steps, a["seg_at"], np.float32(weight), o,
                a["out_at"])
        spans = np.stack(self._run(accumulate_many_range, args))
        lo, hi = spans[:, :, 0].min(axis=0), spans[:, :, 1].max(axis=0)
        rng = self.plans[0]._range
        wrong = np.flatnonzero(((lo < rng.lo) | (hi > rng.hi)) & (a["numels"] > 0))
        return int(wrong[0]) if wrong.size else None

    def _first_beyond(self, steps: np.ndarray, weight: float) -> int | None:
        """The first payload that breaks the finite-output rule (:mod:`dqsgd.quantizers.base`): a
        segment holding a coordinate whose largest |w·x̂| is not a finite float32 (None: none)."""
        a, plan = self.arrays, self.plans[0]
        bound = step_bound(steps, top_code(Scheme.UNIFORM, self.bits, plan.levels), weight)
        sizes = np.concatenate([np.diff(p.starts) for p in self.plans])
        with np.errstate(invalid="ignore"):
            bad = (sizes > 0) & ~(bound <= np.finfo(np.float32).max)
        if not bad.any():
            return None
        return int(np.searchsorted(a["seg_at"], int(np.flatnonzero(bad)[0]), side="right") - 1)

    def _first_bad(self, arr: np.ndarray) -> int | None:
        """The first payload whose header bytes, crc, scales or padding bits are wrong (None: none)."""
        a = self.arrays
        if arr.size < self.total:
            return 0
        ok = np.ones(len(self.plans), dtype=bool)
        head = arr[a["fixed_idx"]] == a["fixed_bytes"]
        ok &= np.logical_and.reduceat(head, _cum([p.head_len - 4 * (p.starts.size - 1) for p in self.plans])[:-1])
        finite = np.isfinite(arr[a["scale_idx"]].view("<f4"))
        seg = a["seg_at"]
        for p in range(len(self.plans)):
            at, size = self.offsets[p], self.plans[p].size
            ok[p] &= (bool(finite[seg[p] : seg[p + 1]].all())
                      and crc32(arr[at : at + size - 4]) == int.from_bytes(arr[at + size - 4 : at + size].tobytes(),
                                                                           "little"))
        ok &= ~((a["tail"] > 0) & ((arr[a["last"]] >> a["tail"]) != 0))
        wrong = np.flatnonzero(~ok)
        return int(wrong[0]) if wrong.size else None


@functools.lru_cache(maxsize=256)
def encode_batch(spec: Spec, bits: int, norm: Norm, gap: int = 0) -> Batch:
    """The batch that encodes the shards ``spec`` of one vector (contiguous, in order): payload j at
    the sum of the sizes (and gaps) before it, each followed by ``gap`` bytes."""
    sizes = [fixed_plan(n, bits, norm, lay).size for n, lay in spec]
    at = _cum([s + gap for s in sizes])
    starts = _cum([n for n, _ in spec])
    return Batch(spec, bits, norm, tuple(int(v) for v in at[:-1]), tuple(int(v) for v in starts[:-1]), int(at[-1]))


@functools.lru_cache(maxsize=256)
def decode_batch(spec: Spec, bits: int, norm: Norm, offsets: tuple[int, ...], out_at: tuple[int, ...]) -> Batch:
    """The batch that adds the payloads at ``offsets`` of one buffer into ``out_at`` of one vector."""
    sizes = [fixed_plan(n, bits, norm, lay).size for n, lay in spec]
    return Batch(spec, bits, norm, offsets, out_at, max(o + s for o, s in zip(offsets, sizes)))
