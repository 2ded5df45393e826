"""Compressed gradients for FSDP2 (``torch.distributed.fsdp.fully_shard``).

    model = ...                                  # fully_shard each block, then the root
    state = dqsgd.fsdp.FSDPState("dqsgd", seed=0, total_steps=N)
    dqsgd.fsdp.compress(model, state)            # one ReduceScatter per FSDP unit
    ...                                          # train as usual
    print(state.compression_stats())             # this rank's bytes, ratios, rounds (docs/api.md)

What is compressed: the gradient reduce-scatter of every FSDP unit — the uplink leg of dqsgd's
``sharded`` protocol (rank w quantizes chunk j of its flat gradient for rank j; one all-to-all moves
the coded bytes; rank j decodes and averages its chunk) — and, with ``FSDPState(param_bits=8)``
(or 4), the parameter all-gather of the forward and backward passes: every rank quantizes its own
shard block-wise, the forward and backward compute on the dequantized weights, the optimizer keeps
updating the full-precision shard. Without ``param_bits`` the all-gather stays FSDP's own, exact.

HSDP (shard inside a node, replicate across nodes): ``compress(model, state, replicate=hook_state)``
with a :class:`dqsgd.ddp.HookState` over the replica group sends the cross-node gradient reduction
through the DDP hook's protocol (any method, budgets, error feedback, the quantized downlink), on a
2-D mesh or on a 1-D shard mesh with a replica group beside it (:mod:`dqsgd.fsdp.hsdp`);
``state=None`` leaves the intra-node legs FSDP's own. See docs/fsdp.md.
"""

from dqsgd.fsdp.comm import DQSGDReduceScatter, compress, reduce_scale
from dqsgd.fsdp.gather import DQSGDAllGather
from dqsgd.fsdp.hsdp import ReplicateLeg
from dqsgd.fsdp.state import CompressionStats, FSDPState, unit_seed

__all__ = ["CompressionStats", "DQSGDAllGather", "DQSGDReduceScatter", "FSDPState", "ReplicateLeg", "compress",
           "reduce_scale", "unit_seed"]
