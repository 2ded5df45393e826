"""Bytes on the links per rank and step, for every topology (the trainer's ledger and the hook)."""

from __future__ import annotations

from typing import NamedTuple, Sequence

from dqsgd.topology.names import TOPOLOGIES


class Legs(NamedTuple):
    """One rank's bytes in one step, per phase: the uplink's and the downlink's, sent and received."""

    up_sent: int
    up_received: int
    down_sent: int
    down_received: int


def leg_traffic(topology: str, up: Sequence[Sequence[int]], down: Sequence[int], rank: int) -> Legs:
    """``rank``'s bytes sent and received in the uplink and the downlink phase of one step.

    ``up[w][j]``: worker w's uplink message for shard j (one shard for ps and allgather);
    ``down[j]``: the downlink message of shard j (ps: the server's one message; allgather: none).
    Rank w runs worker w; ps's server is rank 0.

    * ps: the torch gather pads every payload to the longest, so the server receives (W−1)·max_w up;
      it sends the downlink to W−1 ranks, each receiving one copy.
    * allgather: every rank sends its message to and receives one from each of the W−1 others, all
      padded to the longest; no downlink.
    * sharded: rank r sends Σ_{j≠r} up[r][j] and receives Σ_{w≠r} up[w][r] (an all-to-all with
      exact sizes); the downlink all-gather pads each shard to the longest, (W−1)·max_j down both ways.
    """
    W = len(up)
    if topology == "ps":
        if rank == 0:
            return Legs(0, (W - 1) * max(row[0] for row in up), (W - 1) * down[0], 0)
        return Legs(up[rank][0], 0, 0, down[0])
    if topology == "allgather":
        size = (W - 1) * max(row[0] for row in up)
        return Legs(size, size, 0, 0)
    if topology == "sharded":
        dmax = (W - 1) * max(down) if len(down) else 0
        sent = sum(up[rank]) - up[rank][rank]
        recv = sum(row[rank] for row in up) - up[rank][rank]
        return Legs(sent, recv, dmax, dmax)
    raise ValueError(f"unknown topology {topology!r}: use one of {TOPOLOGIES}")


def wire_traffic(topology: str, up: Sequence[Sequence[int]], down: Sequence[int]) -> tuple[list[int], list[int]]:
    """Bytes per rank on the links in the uplink and the downlink phase of one step: per rank and
    phase, max(bytes sent, bytes received) of :func:`leg_traffic`."""
    legs = [leg_traffic(topology, up, down, r) for r in range(len(up))]
    return [max(g.up_sent, g.up_received) for g in legs], [max(g.down_sent, g.down_received) for g in legs]


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes``: 2·(W−1)/W·nbytes."""
    return 2 * (world - 1) * nbytes // world


def fp32_legs(topology: str) -> int:
    """How many times the fp32 reference sends the whole vector per worker and step: the uplink, and
    the downlink unless the topology has none (allgather: every rank aggregates for itself)."""
    return 1 if topology == "allgather" else 2
