"""The topologies, as objects: each says how many shards a bucket is cut into, which collectives it
needs, who aggregates, whether a downlink crosses the links, and its traffic formulas.

Every decision that depends on the topology asks its object (:func:`topology_of`); no other module
compares a topology's name (tests/topology/test_topology_registry.py greps for it). Adding a topology is one
class here and one line in :data:`REGISTRY`; the step objects, the bucket protocol, the ledger and the
hook read its attributes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence


class Topology(ABC):
    """One way of moving a bucket's payloads between W ranks (a class per topology, one instance each)."""

    name = ""
    collectives: tuple[str, ...] = ()  # the collectives one step issues, in order
    sharded = False     # W shards; rank j aggregates shard j and sends it back quantized at downlink_bits
    server = False      # one rank (0) aggregates for all and waits for the uplinks (backup workers: first arrivals)
    downlink = True     # an aggregate crosses the links back to the ranks (allgather: every rank aggregates)
    hook = False        # the DDP hook runs it

    def __repr__(self) -> str:
        return f"<topology {self.name}>"

    def __str__(self) -> str:
        return self.name

    def shards(self, workers: int) -> int:
        """How many shards a bucket is cut into for ``workers`` ranks (each aggregated on its own)."""
        return workers if self.sharded else 1

    def fp32_legs(self) -> int:
        """How many times the fp32 reference sends the whole vector per worker and step: the uplink,
        and the downlink where the topology has one."""
        return 2 if self.downlink else 1

    @abstractmethod
    def wire_traffic(self, up: Sequence[Sequence[int]], down: Sequence[int]) -> tuple[list[int], list[int]]:
        """Bytes per rank on the links in the uplink and the downlink phase of one step (the trainer's
        transports). ``up[w][j]``: worker w's uplink payload for shard j; ``down[j]``: shard j's downlink
        payload. Rank w runs worker w. Per rank and phase: max(bytes sent, bytes received)."""

    def rank_traffic(self, table: Sequence[Sequence[int]], down: Sequence[int], rank: int) -> tuple[int, int]:
        """(bytes sent, bytes received) by ``rank`` in one step of the DDP hook: ``table[w][j]`` is rank
        w's message for shard j (its flag byte included), ``down[j]`` shard j's downlink message."""
        raise ValueError(f"the hook's traffic is counted for {', '.join(HOOK_TOPOLOGIES)}, not {self.name!r}")


class ParameterServer(Topology):
    """``ps``: rank 0 gathers every payload, aggregates, and broadcasts the update in fp32."""

    name, collectives, server = "ps", ("gather", "broadcast"), True

    def wire_traffic(self, up: Sequence[Sequence[int]], down: Sequence[int]) -> tuple[list[int], list[int]]:
        """The torch gather pads every payload to the longest, so the server receives (W−1)·max_w up; it
        sends the downlink to W−1 ranks, each receiving one copy."""
        W, top = len(up), max(row[0] for row in up)
        return [(W - 1) * top] + [row[0] for row in up[1:]], [(W - 1) * down[0]] + [down[0]] * (W - 1)


class AllGather(Topology):
    """``allgather``: every rank gathers every payload and aggregates them itself; no downlink."""

    name, collectives, downlink, hook = "allgather", ("all_gather",), False, True

    def wire_traffic(self, up: Sequence[Sequence[int]], down: Sequence[int]) -> tuple[list[int], list[int]]:
        """Every rank receives the W−1 other payloads, padded to the longest; no downlink."""
        W = len(up)
        return [(W - 1) * max(row[0] for row in up)] * W, [0] * W

    def rank_traffic(self, table: Sequence[Sequence[int]], down: Sequence[int], rank: int) -> tuple[int, int]:
        """One all-gather of messages padded to the longest, (W−1) copies each way."""
        size = max(row[0] for row in table)
        return (len(table) - 1) * size, (len(table) - 1) * size


class Sharded(Topology):
    """``sharded``: an all-to-all of W shard payloads (rank j aggregates shard j), then an all-gather
    of the W quantized shard aggregates."""

    name, collectives, sharded, hook = "sharded", ("all_to_all", "all_gather"), True, True

    def wire_traffic(self, up: Sequence[Sequence[int]], down: Sequence[int]) -> tuple[list[int], list[int]]:
        """Rank r sends Σ_{j≠r} up[r][j] and receives Σ_{w≠r} up[w][r] (exact sizes); the downlink
        all-gather pads each shard to the longest, (W−1)·max_j down both ways."""
        W = len(up)
        sent = [sum(up[r][j] for j in range(W) if j != r) for r in range(W)]
        recv = [sum(up[w][r] for w in range(W) if w != r) for r in range(W)]
        return [max(a, b) for a, b in zip(sent, recv)], [(W - 1) * max(down)] * W

    def rank_traffic(self, table: Sequence[Sequence[int]], down: Sequence[int], rank: int) -> tuple[int, int]:
        """An all-to-all with exact sizes, then an all-gather of downlinks padded to the longest."""
        dmax = (len(table) - 1) * max(down)
        sent = sum(table[rank]) - table[rank][rank]
        recv = sum(row[rank] for row in table) - table[rank][rank]
        return sent + dmax, recv + dmax


PS, ALLGATHER, SHARDED = ParameterServer(), AllGather(), Sharded()
REGISTRY: dict[str, Topology] = {t.name: t for t in (PS, ALLGATHER, SHARDED)}  # every topology, by name
TOPOLOGIES = tuple(REGISTRY)                                          # their names (config keys, --topology)
HOOK_TOPOLOGIES = tuple(n for n, t in REGISTRY.items() if t.hook)     # those of the DDP hook (no server in DDP)
SIMULATED_DEFAULT = PS.name   # the topology of a simulated run that names none
PROCESSES_DEFAULT = SHARDED.name  # the topology of a run over processes that names none


def topology_of(topology: object, allowed: Sequence[str] | None = None) -> Topology:
    """The topology named ``topology`` (or that object itself) if it is one of ``allowed`` (None: any
    registered), else a ValueError naming them."""
    names = tuple(REGISTRY) if allowed is None else tuple(allowed)
    name = topology.name if isinstance(topology, Topology) else topology
    if not isinstance(name, str) or name not in names or name not in REGISTRY:
        raise ValueError(f"unknown topology {name!r}: use one of {', '.join(names)}")
    return REGISTRY[name]


def check_topology(topology: object, allowed: Sequence[str] = TOPOLOGIES) -> str:
    """``topology``'s name if it is one of ``allowed``, else a ValueError naming them."""
    return topology_of(topology, allowed).name


def wire_traffic(topology: object, up: Sequence[Sequence[int]], down: Sequence[int]) -> tuple[list[int], list[int]]:
    """:meth:`Topology.wire_traffic` of the topology named ``topology``."""
    return topology_of(topology).wire_traffic(up, down)
