"""How a flat vector of ``numel`` coordinates is split into ``world`` shards (topology ``sharded``).

Every rank of the sharded topology serves one shard of each bucket: it receives shard j of every
worker's gradient, averages it, and sends the averaged shard back. The split is contiguous and as
even as possible: the first ``numel % world`` shards hold one coordinate more. The simulation, the
torch transport and the DDP hook all use this one function, so they agree on the boundaries.
"""

from __future__ import annotations

__all__ = ["DOWNLINK", "shard_bounds", "shard_sizes"]

from dqsgd.core.rng import DOWNLINK  # the seed stream of the downlink's stochastic rounding (re-exported)


def shard_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """``[(lo_0, hi_0), …, (lo_{W-1}, hi_{W-1})]``: shard j is ``flat[lo_j:hi_j]``.

    Contiguous, covering ``[0, numel)`` in order; sizes differ by at most one (larger first).
    A shard is empty when ``numel < world``.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an integer >= 0, got {numel!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an integer >= 1, got {world!r}")
    base, extra = divmod(numel, world)
    bounds, lo = [], 0
    for j in range(world):
        hi = lo + base + (1 if j < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def shard_sizes(param_sizes: tuple[int, ...] | list[int], lo: int, hi: int) -> tuple[int, ...]:
    """The pieces of the parameter tensors (flat sizes ``param_sizes``, in order) inside ``[lo, hi)``.

    A shard is quantized as a vector of its own; a per-tensor layout (one scale per parameter
    tensor) becomes one scale per piece of a tensor inside the shard. Empty pieces are dropped, so
    the sizes are all > 0 and sum to ``hi - lo``.
    """
    total = sum(int(s) for s in param_sizes)
    if not 0 <= lo <= hi <= total:
        raise ValueError(f"shard [{lo}, {hi}) is not inside [0, {total}]")
    out, start = [], 0
    for s in param_sizes:
        a, b = max(start, lo), min(start + int(s), hi)
        if b > a:
            out.append(b - a)
        start += int(s)
    return tuple(out)
