"""The topologies, as objects: each says how many shards a bucket is cut into, which collectives it
needs, who aggregates, whether a downlink crosses the links, and its traffic formulas.

Every decision that depends on the topology asks its object (:func:`topology_of`); no other module
compares a topology's name (tests/topology/test_topology_registry.py greps for it). Adding a topology is one
class here and one line in :data:`REGISTRY`; the step objects, the bucket protocol, the ledger and the
hook read its attributes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple, Sequence

if TYPE_CHECKING:
    from dqsgd.topology.group import Group


class Legs(NamedTuple):
    """One rank's bytes in one step, per phase: the uplink's and the downlink's, sent and received."""

    up_sent: int
    up_received: int
    down_sent: int
    down_received: int

    def plus(self, up: int, down: int = 0) -> Legs:
        """With ``up`` more bytes sent and received in the uplink phase, ``down`` in the downlink's (the
        exchange's size tables: all-gathers)."""
        return Legs(self.up_sent + up, self.up_received + up, self.down_sent + down, self.down_received + down)


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes``: 2·(W−1)/W·nbytes."""
    return 2 * (world - 1) * nbytes // world


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

    def split(self, group: Group) -> tuple[Group, Group | None]:
        """The groups one step of the exchange (:mod:`dqsgd.topology.exchange`) runs over, as seen by
        ``group``'s rank: the one its sequence (this topology's collectives) runs in, and the one whose
        ranks then average their results (None: none; a hierarchical topology has one). Where there is
        a second group, the exchange hands :meth:`legs` the bytes of each other group's update (its
        all-gather of the groups' results) as the entries of ``down`` past the shards' (they count
        there), and its step's table holds the W ranks' rows, the groups' in group order."""
        return group, None

    @property
    def feeds_norms(self) -> bool:
        """Whether the DDP hook's exchange gathers every worker's norms for a policy that reads them (the
        link policy): a hook topology whose ranks all run one sequence (no second level of groups)."""
        return self.hook and type(self).split is Topology.split

    def fp32_legs(self) -> int:
        """How many times the fp32 reference sends the whole vector per worker and step: the uplink,
        and the downlink where the topology has one."""
        return 2 if self.downlink else 1

    @abstractmethod
    def legs(self, up: Sequence[Sequence[int]], down: Sequence[int], rank: int) -> Legs:
        """``rank``'s bytes sent and received in the uplink and the downlink phase of one step.
        ``up[w][j]``: worker w's uplink message for shard j (one shard where the topology has one);
        ``down[j]``: shard j's downlink message. Rank w runs worker w."""

    def wire_traffic(self, up: Sequence[Sequence[int]], down: Sequence[int]) -> tuple[list[int], list[int]]:
        """Bytes per rank on the links in the uplink and the downlink phase of one step (the trainer's
        transports): per rank and phase, max(bytes sent, bytes received) of :meth:`legs`."""
        legs = [self.legs(up, down, r) for r in range(len(up))]
        return [max(g.up_sent, g.up_received) for g in legs], [max(g.down_sent, g.down_received) for g in legs]

    def rank_traffic(self, table: Sequence[Sequence[int]], down: Sequence[int], rank: int) -> tuple[int, int]:
        """(bytes sent, bytes received) by ``rank`` in one step of the DDP hook: ``table[w][j]`` is rank
        w's message for shard j (its flag byte included), ``down[j]`` shard j's downlink message."""
        if not self.hook:
            raise ValueError(f"the hook's traffic is counted for {', '.join(HOOK_TOPOLOGIES)}, not {self.name!r}")
        g = self.legs(table, down, rank)
        return g.up_sent + g.down_sent, g.up_received + g.down_received


class ParameterServer(Topology):
    """``ps``: rank 0 gathers every payload, aggregates, and broadcasts the update in fp32."""

    name, collectives, server = "ps", ("gather", "broadcast"), True

    def legs(self, up: Sequence[Sequence[int]], down: Sequence[int], rank: int) -> Legs:
        """The torch gather pads every payload to the longest, so the server (rank 0) receives
        (W−1)·max_w up; it sends the downlink to W−1 ranks, each receiving one copy."""
        if rank == 0:
            return Legs(0, (len(up) - 1) * max(row[0] for row in up), (len(up) - 1) * down[0], 0)
        return Legs(up[rank][0], 0, 0, down[0])


class AllGather(Topology):
    """``allgather``: every rank gathers every payload and aggregates them itself; no downlink."""

    name, collectives, downlink, hook = "allgather", ("all_gather",), False, True

    def legs(self, up: Sequence[Sequence[int]], down: Sequence[int], rank: int) -> Legs:
        """Every rank sends its message to and receives one from each of the W−1 others, all padded to
        the longest; no downlink."""
        size = (len(up) - 1) * max(row[0] for row in up)
        return Legs(size, size, 0, 0)


class Sharded(Topology):
    """``sharded``: an all-to-all of W shard payloads (rank j aggregates shard j), then an all-gather
    of the W quantized shard aggregates."""

    name, collectives, sharded, hook = "sharded", ("all_to_all", "all_gather"), True, True

    def legs(self, up: Sequence[Sequence[int]], down: Sequence[int], rank: int) -> Legs:
        """Rank r sends Σ_{j≠r} up[r][j] and receives Σ_{w≠r} up[w][r] (an all-to-all with exact
        sizes); the downlink all-gather pads each shard to the longest, (W−1)·max_j down both ways."""
        dmax = (len(up) - 1) * max(down) if len(down) else 0
        sent = sum(up[rank]) - up[rank][rank]
        recv = sum(row[rank] for row in up) - up[rank][rank]
        return Legs(sent, recv, dmax, dmax)


PS, ALLGATHER, SHARDED = ParameterServer(), AllGather(), Sharded()
REGISTRY: dict[str, Topology] = {t.name: t for t in (PS, ALLGATHER, SHARDED)}  # every topology, by name
TOPOLOGIES = tuple(REGISTRY)                                          # their names (config keys, --topology)
HOOK_TOPOLOGIES = tuple(n for n, t in REGISTRY.items() if t.hook)     # those of the DDP hook (no server in DDP)
SIMULATED_DEFAULT = PS.name   # the topology of a simulated run that names none
PROCESSES_DEFAULT = SHARDED.name  # the topology of a run over processes that names none


def run_topology(name: str | None, processes: bool) -> str:
    """The topology a run runs: the one it names, else its transport's default (:data:`PROCESSES_DEFAULT`
    over processes, :data:`SIMULATED_DEFAULT` in the simulation)."""
    return name or (PROCESSES_DEFAULT if processes else SIMULATED_DEFAULT)


def topology_of(topology: object, allowed: Sequence[str] | None = None) -> Topology:
    """The topology named ``topology`` (or that object itself) if it is one of ``allowed`` (None: any
    registered), else a ValueError naming them."""
    names = tuple(REGISTRY) if allowed is None else tuple(allowed)
    name = topology.name if isinstance(topology, Topology) else topology
    if not isinstance(name, str) or name not in names or name not in REGISTRY:
        raise ValueError(f"unknown topology {name!r}: use one of {', '.join(names)}")
    return REGISTRY[name]


def check_topology(topology: object, allowed: Sequence[str] | None = None) -> str:
    """``topology``'s name if it is one of ``allowed`` (None: any registered, one registered later too),
    else a ValueError naming them."""
    return topology_of(topology, allowed).name


def wire_traffic(topology: object, up: Sequence[Sequence[int]], down: Sequence[int]) -> tuple[list[int], list[int]]:
    """:meth:`Topology.wire_traffic` of the topology named ``topology``."""
    return topology_of(topology).wire_traffic(up, down)
