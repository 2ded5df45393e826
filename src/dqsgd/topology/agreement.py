"""One rank fingerprint: do the ranks run the same configuration? Checked once, at the first step.

A configuration is a mapping of named fields (a method and its options, the topology, the codings,
the downlink width, warm-up steps, checkpoint_every, the dqsgd version, ...). Its fingerprint is a
fixed-size vector of :data:`SLOTS` integers: field ``k`` goes to slot ``crc32(k) mod SLOTS``, where
the 56-bit hashes of ``(k, value)`` are combined by XOR, so a field that differs, or that one rank
has and another lacks, changes its slot. Every rank sends the same number of integers whatever its
configuration — the check itself cannot crash an unequal collective — and receives every rank's
vector, so every rank finds the same differing slots and raises the same :class:`RankDisagreement`
naming the fields in them.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from typing import Any, Callable, Mapping, Sequence

SLOTS = 64
_HEAD = 2  # [this rank refuses for a reason of its own, number of fields]


class RankDisagreement(RuntimeError):
    """Ranks run different configurations, or computed different results from the same bytes."""


def digest(value: Any) -> int:
    """A 56-bit hash of a JSON-able value (other values by their ``repr``)."""
    text = json.dumps(value, sort_keys=True, default=repr)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def slot_of(name: str) -> int:
    return zlib.crc32(name.encode()) % SLOTS


def fingerprint(fields: Mapping[str, Any]) -> list[int]:
    """The fixed-size fingerprint of ``fields`` (:data:`SLOTS` integers)."""
    out = [0] * SLOTS
    for name, value in fields.items():
        out[slot_of(name)] ^= digest([name, value])
    return out


def agree(fields: Mapping[str, Any], gather: Callable[[list[int]], Sequence[Sequence[int]]], rank: int,
          refused: bool = False, what: str = "to start") -> None:
    """Compare ``fields`` across ranks; ``gather(ints)`` returns every rank's ``ints`` in rank order
    (a fixed-size all-gather). ``refused``: this rank stops for its own reason (it raises that after
    this returns); the others then stop too, saying that rank refused ``what``.

    Raises:
      RankDisagreement: on every rank alike, naming the fields whose slots differ from rank 0's.
    """
    mine = [int(refused), len(fields)] + fingerprint(fields)
    rows = [list(r) for r in gather(mine)]
    if refused:
        return
    stopped = [r for r, v in enumerate(rows) if v[0]]
    if stopped:
        raise RankDisagreement(f"rank {rank}: rank(s) {stopped} refused {what} (see their message)")
    slots = {s: [r for r, v in enumerate(rows) if v[_HEAD + s] != rows[0][_HEAD + s]] for s in range(SLOTS)}
    slots = {s: ranks for s, ranks in slots.items() if ranks}
    if not slots and all(v[1] == rows[0][1] for v in rows):
        return
    named = sorted(k for k in fields if slot_of(k) in slots)
    shown = "; ".join(f"{k} (rank(s) {slots[slot_of(k)]} differ from rank 0; here {fields[k]!r})" for k in named[:8])
    missing = sorted(set(slots) - {slot_of(k) for k in fields})
    if missing or not named:
        shown += ("; " if shown else "") + "and field(s) this rank does not have (the ranks' key sets differ)"
    raise RankDisagreement(f"rank {rank}: the ranks run different configurations: {shown}")
