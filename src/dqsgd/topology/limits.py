"""One size bound for everything a peer announces: refused before a byte is allocated.

A receiver always knows how many elements a payload may carry, hence the most bytes any valid
coding of them can take (:meth:`dqsgd.method.pipeline.Method.max_payload_bytes`, the downlink's exact size);
a peer's announced size above that cap raises :class:`~dqsgd.codecs.PayloadError` naming the peer
and the cap. Every rank sees the same announcements (they travel in an all-gather), so every rank
refuses together and nobody waits.
"""

from __future__ import annotations

from typing import Sequence

from dqsgd.codecs import PayloadError


def check_sizes(sizes: Sequence[int], caps: Sequence[int | None], who: str) -> None:
    """Refuse (PayloadError) an announced payload size above its cap, before anything is allocated.

    ``caps[j]`` caps ``sizes[j]``; one cap applies to every size; None: no cap.
    """
    caps = list(caps) * len(sizes) if len(caps) == 1 else list(caps)
    if len(caps) != len(sizes):
        raise ValueError(f"{len(caps)} caps for {len(sizes)} sizes")
    for j, (n, cap) in enumerate(zip(sizes, caps)):
        if n < 0 or (cap is not None and n > cap):
            piece = f" (shard {j})" if len(sizes) > 1 else ""
            raise PayloadError(f"{who} announced a payload of {n} bytes{piece}; the method produces at most "
                               f"{cap} bytes here: refused before allocating")


def check_table(table: Sequence[Sequence[int]], caps: Sequence[int | None], who: str) -> None:
    """:func:`check_sizes` of every rank's row ``table[w]`` (rank w's sizes, one per shard)."""
    for w, row in enumerate(table):
        check_sizes(row, caps, f"{who}rank {w}")
