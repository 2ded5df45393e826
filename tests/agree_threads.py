"""Run :func:`dqsgd.topology.agreement.agree` for several simulated ranks at once: one thread per rank
and an all-gather built on a barrier (every exchange of the real collective, in the same order)."""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence


def agree_all(per_rank: Sequence[Mapping[str, Any]], timeout: float = 30.0) -> list[BaseException | None]:
    """Each rank's outcome: None (agreed) or the exception its ``agree`` raised."""
    from dqsgd.topology.agreement import agree

    world = len(per_rank)
    barrier = threading.Barrier(world, timeout=timeout)
    slots: list[list[int]] = [[] for _ in range(world)]
    out: list[BaseException | None] = [None] * world

    def run(rank: int) -> None:
        def gather(ints: list[int]) -> list[list[int]]:
            slots[rank] = list(ints)
            barrier.wait()
            rows = [list(s) for s in slots]
            barrier.wait()  # every rank read this exchange before the next one writes
            if len({len(r) for r in rows}) != 1:
                raise AssertionError(f"an unequal all-gather: lengths {[len(r) for r in rows]}")
            return rows

        try:
            agree(per_rank[rank], gather, rank)
        except BaseException as e:  # noqa: BLE001 — returned to the test
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out
