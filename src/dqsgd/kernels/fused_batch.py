"""Compiled (numba) loops of the batched codec (:mod:`dqsgd.kernels.batch`): many FIXED uniform
payloads in one call.

Each function runs the single-payload kernel of :mod:`dqsgd.kernels.fused` (``encode_range``,
``accumulate_range``) over every payload of a batch in turn, inside one compiled call: the bytes and
the sums are those kernels' own, and the per-payload Python overhead is gone. A call does chunks
``[c_lo, c_hi)`` of every payload (each clipped to its own chunk count), so
:func:`dqsgd.codecs.threads.run_split` can hand chunk ranges to threads; inside a range the payloads
are taken in their order, so a coordinate that several payloads add to (the W payloads of one shard)
receives them in that order at any thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from dqsgd.kernels.fused import CHUNK, accumulate_range, encode_range


@njit(cache=True, nogil=True)
def encode_many_range(x, numels, starts, starts_at, inv, inv_at, sf, one_bit, keys, width, offset, out, body_at,
                      body_len, c_lo, c_hi):  # pragma: no cover - compiled
    """Shard j = ``x[Σ_{i<j} numels[i] :][: numels[j]]``, its segment starts ``starts[starts_at[j] :
    starts_at[j+1]]`` (local), its s/r ``inv[inv_at[j] : inv_at[j+1]]`` and its key ``keys[j]``:
    chunks [c_lo, c_hi) of it quantized and packed into ``out[body_at[j] :][: body_len[j]]``."""
    x0 = 0
    for j in range(numels.size):
        n = numels[j]
        hi = min(c_hi, (n + CHUNK - 1) // CHUNK)
        if c_lo < hi:
            encode_range(x[x0 : x0 + n], starts[starts_at[j] : starts_at[j + 1]], inv[inv_at[j] : inv_at[j + 1]], sf,
                         one_bit, keys[j], width, offset, out[body_at[j] : body_at[j] + body_len[j]], c_lo, hi)
        x0 += n


@njit(cache=True, nogil=True)
def accumulate_many_range(buf, body_at, body_len, width, offset, one_bit, numels, starts, starts_at, steps, steps_at,
                          w, out, out_at, c_lo, c_hi):  # pragma: no cover - compiled
    """Payload p's FIXED body ``buf[body_at[p] :][: body_len[p]]`` (numels[p] codes, segment starts
    ``starts[starts_at[p] : starts_at[p+1]]``, steps ``steps[steps_at[p] : steps_at[p+1]]``) added as
    ``out[out_at[p] :][: numels[p]] += w·(c·step)``, chunks [c_lo, c_hi), payloads in order. Returns
    (P, 2) int32: each payload's (min code, max code) in the range."""
    spans = np.empty((numels.size, 2), np.int32)
    for p in range(numels.size):
        n = numels[p]
        hi = min(c_hi, (n + CHUNK - 1) // CHUNK)
        spans[p, 0], spans[p, 1] = np.int32(0x7FFFFFFF), np.int32(-0x7FFFFFFF)
        if c_lo < hi:
            lo_c, hi_c = accumulate_range(buf[body_at[p] : body_at[p] + body_len[p]], width, offset, one_bit,
                                          starts[starts_at[p] : starts_at[p + 1]],
                                          steps[steps_at[p] : steps_at[p + 1]], w, out[out_at[p] : out_at[p] + n],
                                          c_lo, hi)
            spans[p, 0], spans[p, 1] = lo_c, hi_c
    return spans
