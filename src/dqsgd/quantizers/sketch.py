"""Count sketch: a linear map of a d-vector to an r × c table, and heavy-hitter recovery from it.

Row ρ of the sketch has a bucket hash h_ρ: [d] → [c] and a sign hash s_ρ: [d] → {−1, +1}:

    S(x)[ρ, j] = Σ_{i : h_ρ(i) = j} s_ρ(i) · x_i,        x̃_i = median_ρ s_ρ(i) · S[ρ, h_ρ(i)].

``S`` is linear, so the sum of W workers' sketches is the sketch of their summed vectors: the sketches
can be added up on the way (a parameter server, an all-gather, or column blocks on the shard servers).
Each row's estimate of x_i is x_i plus the signed sum of the other coordinates that share its bucket;
the median of r rows is within that of x_i whenever more than half the rows carry less than it.

Guarantee the tests use (deterministic given the hashes): let H be the k heavy coordinates and
L = Σ_{i ∉ H} |x_i| the light mass. If every coordinate shares its bucket with another heavy one in
fewer than r/2 rows, every light estimate is at most L in magnitude and every heavy one at least
min_{i ∈ H} |x_i| − L; so when min_H |x_i| > 2L the k largest estimates are exactly H.

The hashes are drawn once from a seeded generator that every worker builds from the run's seed
(:func:`dqsgd.core.rng.seed_for` of the stream ``SKETCH``): the same on every process, never sent.
The registry entry ``sketch`` is what ``dqsgd.encode(scheme="sketch")`` uses: the table of a tensor,
with hashes from the caller's generator and ``layout.bucket`` columns (a method uses
:class:`dqsgd.topology.sketched.SketchedStep`, which owns its hashes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme, SchemeQuantizer
from dqsgd.quantizers.segments import flat_float, require_finite

DEFAULT_ROWS = 5


@dataclass(frozen=True)
class CountSketch:
    """The hashes of an r × c count sketch of d-vectors.

    Attributes:
      flat: int64 (r, d): row ρ's bucket of coordinate i, as an index into the flattened table
        (ρ·c + h_ρ(i)).
      signs: float32 (r, d): s_ρ(i) ∈ {−1, +1}.
      cols: c.
    """

    flat: torch.Tensor
    signs: torch.Tensor
    cols: int

    @classmethod
    def draw(cls, numel: int, rows: int, cols: int, generator: torch.Generator) -> CountSketch:
        """Hashes for ``numel`` coordinates: uniform buckets and signs from ``generator`` (CPU)."""
        if rows < 1 or cols < 1 or numel < 0:
            raise ValueError(f"a count sketch needs rows >= 1 and cols >= 1, got {rows} x {cols} for {numel} values")
        buckets = torch.randint(0, cols, (rows, numel), generator=generator, dtype=torch.int64)
        signs = torch.randint(0, 2, (rows, numel), generator=generator, dtype=torch.int64).to(torch.float32) * 2 - 1
        offsets = torch.arange(rows, dtype=torch.int64).unsqueeze(1) * cols
        return cls(buckets + offsets, signs, cols)

    @property
    def rows(self) -> int:
        return int(self.flat.shape[0])

    @property
    def numel(self) -> int:
        return int(self.flat.shape[1])

    def sketch(self, x: torch.Tensor) -> torch.Tensor:
        """S(x), float32 (r, c). The sums run in coordinate order (index_add_ on the CPU)."""
        x = x.reshape(-1).to(torch.float32).cpu()
        if x.numel() != self.numel:
            raise ValueError(f"the sketch was drawn for {self.numel} values, got {x.numel()}")
        table = torch.zeros(self.rows * self.cols, dtype=torch.float32)
        table.index_add_(0, self.flat.reshape(-1), (self.signs * x).reshape(-1))
        return table.reshape(self.rows, self.cols)

    def estimate(self, table: torch.Tensor) -> torch.Tensor:
        """x̃: the median over rows of each coordinate's signed bucket (float32, d)."""
        if tuple(table.shape) != (self.rows, self.cols):
            raise ValueError(f"a table of shape {tuple(table.shape)} for a {self.rows} x {self.cols} sketch")
        rows = table.reshape(-1)[self.flat] * self.signs
        return rows.median(dim=0).values if self.rows > 1 else rows[0]


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` coordinates of largest |score|, in increasing index order; ties go to the lower index
    (a stable sort: the same on every process)."""
    order = torch.argsort(scores.abs(), descending=True, stable=True)
    return torch.sort(order[: max(0, min(k, scores.numel()))]).values


def sketch_message(table: torch.Tensor, dtype: torch.dtype = torch.float32) -> Quantized:
    """The wire message of a sketch table: scheme SKETCH, shape (r, c), raw float32 values."""
    values = table.reshape(-1).to(torch.float32).contiguous()
    if values.numel():
        require_finite(values.abs().amax().reshape(1), "sketch")
    empty_i = torch.zeros(0, dtype=torch.int32)
    empty_f = torch.zeros(0, dtype=torch.float32)
    return Quantized(Scheme.SKETCH, 32, 1, empty_i, empty_f, Layout(), tuple(int(s) for s in table.shape),
                     Norm.NONE, values, dtype)


class SketchQuantizer(SchemeQuantizer):
    """The registry entry of the count sketch: fp32 sums, no scales, 32 bits.

    ``quantize(x, bits, generator, layout=Layout(bucket=c))``: the (5 × c) table of ``x`` with hashes
    drawn from ``generator``. A method (``sketched-sgd``) runs :class:`dqsgd.topology.sketched.SketchedStep`."""

    name, scheme, width = "sketch", Scheme.SKETCH, 32
    segment_scales = False

    def bits_error(self, bits: int) -> str | None:
        return None if bits == 32 else "the sketch scheme sends fp32 sums: bits must be 32"

    def quantize(self, x, bits, generator=None, *, layout=Layout(), norm=Norm.MAX, scaled=False, scalers=None,
                 clip=None) -> Quantized:
        if generator is None or layout.bucket < 1 or layout.sizes is not None:
            raise ValueError("the sketch scheme needs a generator (its hashes) and the column count as "
                             "layout=Layout(bucket=c); the sketched-sgd method runs "
                             "dqsgd.topology.sketched.SketchedStep (its own two rounds), not a one-message pipeline such as the DDP hook")
        flat = flat_float(x)
        cs = CountSketch.draw(flat.numel(), DEFAULT_ROWS, layout.bucket, generator)
        return sketch_message(cs.sketch(flat), x.dtype)


SKETCH = SketchQuantizer()
