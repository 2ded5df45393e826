"""An FSDP unit's protocol: the ``sharded`` :class:`~dqsgd.topology.bucket.BucketProtocol` of its flat
gradient, and the method whose message is what one rank really sends (W shard payloads)."""

from __future__ import annotations

from dqsgd.method.config import MethodConfig
from dqsgd.method.pipeline import Method
from dqsgd.topology.bucket import BucketProtocol, shard_methods
from dqsgd.topology.downspec import FP32_DOWNLINK
from dqsgd.topology.registry import SHARDED


class ShardedMethod(Method):
    """A unit's method whose message is what one rank really sends: W shard payloads, each with its
    own header. Its policy (and a budget's arithmetic) costs a width B as Σ_j message_bits_j(B), so a
    budget counts every shard's header — with the whole vector's single header, a unit small enough for
    headers to matter would overspend its budget."""

    def __init__(self, config: MethodConfig, numel: int, total_steps: int, pieces: list[int], world: int):
        self.shard_methods = shard_methods(config, numel, total_steps, pieces, world)[1]
        super().__init__(config, numel, total_steps, pieces)

    def message_bits(self, bits: int) -> int:
        return sum(Method.message_bits(m, bits) for m in self.shard_methods)


def unit_protocol(config: MethodConfig, numel: int, total_steps: int, pieces: list[int], world: int,
                  seed: int) -> BucketProtocol:
    """The unit's sharded protocol: its W shards, its keys (``seed``), no downlink (fp32)."""
    method = ShardedMethod(config, numel, total_steps, pieces, world)
    proto = BucketProtocol(config, numel, pieces, topology=SHARDED.name, workers=world, seed=seed,
                           total_steps=total_steps, method=method, spec=FP32_DOWNLINK)
    proto.charge_side(scatter=True)  # the sizes and the entropy sample's statistics come out of the budget
    return proto
