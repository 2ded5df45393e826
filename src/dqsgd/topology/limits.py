"""One size bound for everything a peer announces: refused before a byte is allocated.

A receiver always knows how many elements a payload may carry, hence the most bytes any valid
coding of them can take (:meth:`dqsgd.method.pipeline.Method.max_payload_bytes`, the downlink's exact size,
:func:`dqsgd.codecs.sketch_wire.index_message_size` for Sketched SGD's index messages);
a peer's announced size above that cap raises :class:`~dqsgd.codecs.PayloadError` naming the peer
and the cap. Every rank sees the same announcements (they travel in an all-gather), so every rank
refuses together and nobody waits.

Every received size goes through :func:`check_sizes`, and a cap is never optional: the transports
(``gather``, ``broadcast``, ``exchange``, ``share``, the backup workers' point-to-point messages),
the DDP hook's and FSDP's exchanges all take one, and a missing cap (None) is a TypeError, not an
unbounded receive.
"""

from __future__ import annotations

from typing import Sequence

from dqsgd.codecs import PayloadError


def check_sizes(sizes: Sequence[int], caps: Sequence[int], who: str) -> None:
    """Refuse (PayloadError) an announced payload size above its cap, before anything is allocated.

    ``caps[j]`` caps ``sizes[j]``; one cap applies to every size. A cap that is not an integer
    (None: a caller that gave none) is a TypeError: no peer message goes unbounded.
    """
    caps = list(caps) * len(sizes) if len(caps) == 1 else list(caps)
    if len(caps) != len(sizes):
        raise ValueError(f"{len(caps)} caps for {len(sizes)} sizes")
    if not all(isinstance(c, int) for c in caps):
        raise TypeError(f"{who}: every received size needs an integer cap, got {caps}")
    for j, (n, cap) in enumerate(zip(sizes, caps)):
        if n < 0 or n > cap:
            piece = f" (shard {j})" if len(sizes) > 1 else ""
            raise PayloadError(f"{who} announced a payload of {n} bytes{piece}; the method produces at most "
                               f"{cap} bytes here: refused before allocating")


def check_table(table: Sequence[Sequence[int]], caps: Sequence[int], who: str) -> None:
    """:func:`check_sizes` of every rank's row ``table[w]`` (rank w's sizes, one per shard)."""
    for w, row in enumerate(table):
        check_sizes(row, caps, f"{who}rank {w}")
