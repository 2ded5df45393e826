"""Bytes on the links per rank and step, for every topology (the trainer's ledger and the hook)."""

from __future__ import annotations

from typing import Sequence

from dqsgd.topology.names import TOPOLOGIES


def wire_traffic(topology: str, up: Sequence[Sequence[int]], down: Sequence[int]) -> tuple[list[int], list[int]]:
    """Bytes per rank on the links in the uplink and the downlink phase of one step.

    ``up[w][j]``: worker w's uplink payload for shard j (one shard for ps and allgather);
    ``down[j]``: the downlink payload of shard j (ps: the server's one message; allgather: none).
    Rank w runs worker w; ps's server is rank 0. Per rank and phase: max(bytes sent, bytes received).

    * ps: the torch gather pads every payload to the longest, so the server receives (W−1)·max_w up;
      it sends the downlink to W−1 ranks, each receiving one copy.
    * allgather: every rank receives the W−1 other payloads, padded to the longest; no downlink.
    * sharded: rank r sends Σ_{j≠r} up[r][j] and receives Σ_{w≠r} up[w][r] (an all-to-all with
      exact sizes); the downlink all-gather pads each shard to the longest, (W−1)·max_j down both ways.
    """
    W = len(up)
    if topology == "ps":
        top = max(row[0] for row in up)
        return [(W - 1) * top] + [row[0] for row in up[1:]], [(W - 1) * down[0]] + [down[0]] * (W - 1)
    if topology == "allgather":
        return [(W - 1) * max(row[0] for row in up)] * W, [0] * W
    if topology == "sharded":
        sent = [sum(up[r][j] for j in range(W) if j != r) for r in range(W)]
        recv = [sum(up[w][r] for w in range(W) if w != r) for r in range(W)]
        return [max(a, b) for a, b in zip(sent, recv)], [(W - 1) * max(down)] * W
    raise ValueError(f"unknown topology {topology!r}: use one of {TOPOLOGIES}")


def rank_traffic(topology: str, table: Sequence[Sequence[int]], down: Sequence[int], rank: int) -> tuple[int, int]:
    """(bytes sent, bytes received) by ``rank`` in one step of the DDP hook: ``table[w][j]`` is rank
    w's message for shard j (its flag byte included), ``down[j]`` shard j's downlink message.

    * allgather: one all-gather of messages padded to the longest, (W−1) copies each way;
    * sharded: an all-to-all with exact sizes, then an all-gather of downlinks padded to the longest.
    """
    W = len(table)
    if topology == "allgather":
        size = max(row[0] for row in table)
        return (W - 1) * size, (W - 1) * size
    if topology == "sharded":
        dmax = (W - 1) * max(down)
        sent = sum(table[rank]) - table[rank][rank]
        recv = sum(row[rank] for row in table) - table[rank][rank]
        return sent + dmax, recv + dmax
    raise ValueError(f"the hook's traffic is counted for allgather and sharded, not {topology!r}")


def fp32_legs(topology: str) -> int:
    """How many times the fp32 reference sends the whole vector per worker and step: the uplink, and
    the downlink unless the topology has none (allgather: every rank aggregates for itself)."""
    return 1 if topology == "allgather" else 2
