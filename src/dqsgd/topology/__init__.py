"""The per-bucket protocol of every topology: what one step sends, receives and computes.

The trainer's steps (:mod:`dqsgd.topology.step`), the torch.distributed transports and the DDP hook run a
bucket (a flat vector of ``numel`` coordinates made of tensors of ``param_sizes``) through the same
object, :class:`~dqsgd.topology.bucket.BucketProtocol`. It is sans-IO: it returns what to send and
takes what was received; the engines only move bytes (or ``uint8`` tensors) and futures.

One step of a bucket, for worker ``w`` of ``W`` (``P = BucketProtocol(config, numel, param_sizes,
topology=..., workers=W, seed=..., bucket=i, total_steps=N, downlink_bits=b)``)::

    # uplink leg (also what a reduce-scatter needs, without the downlink leg)
    payloads, res = P.encode(w, flat, bits, step, generator, residuals, scalers)   # one per shard
    P.check_sizes(table, bits, who)           # announced sizes table[w][j] <= P.caps(bits)[j], before allocating
    avg_j = P.reduce(j, received_j, bits, voters=...)   # decode + aggregate shard j (mean: weight 1/W)
    # downlink leg (topology sharded: every rank serves shard j = rank; ps: rank 0 serves the one shard)
    down_j = P.encode_down(j, avg_j, step)     # exact size P.down_sizes()[j]
    update = P.decode_down(all_down)           # the same bytes -> the same update on every rank

* shards: ``sharded`` cuts the bucket into W contiguous shards (:func:`dqsgd.core.sharding.shard_bounds`),
  each a vector of its own (``P.shards[j]`` is its :class:`~dqsgd.method.pipeline.Method`); ``ps`` and
  ``allgather`` have one shard, the whole bucket.
* keys (:mod:`dqsgd.topology.bucket`): worker w's payload for shard j of bucket i at step n rounds
  with ``HashRNG(seed_for(seed, QUANT, i), n, w·S + j)`` (S shards); the downlink of shard j with
  ``HashRNG(seed_for(seed, DOWNLINK, i), n, j)``. Bucket 0 is the trainer's whole model.
* vote (signSGD): :func:`dqsgd.quantizers.majority_vote` — ``sign(Σ_{voters} c_w)``, ties -> +1, no
  voter -> 0; the vote's downlink is its signs at 1 bit.
* sizes (:mod:`dqsgd.topology.refusal`): one bound per payload, checked before any allocation.
* rank agreement (:mod:`dqsgd.topology.agreement`): a fixed-size fingerprint of the configuration
  compared across ranks with a fixed-size collective; every rank raises the same error.
* topologies (:mod:`dqsgd.topology.registry`): one object per topology — its shard count, collectives,
  who aggregates, whether a downlink crosses the links, its traffic formulas (bytes per rank and phase).

Topology names: :data:`TOPOLOGIES` (``dqsgd.topology.registry``), the one list; no other module
compares a topology's name.
"""

from dqsgd.topology.names import FP32, HOOK_TOPOLOGIES, TOPOLOGIES, check_downlink_bits, check_topology

__all__ = ["FP32", "HOOK_TOPOLOGIES", "TOPOLOGIES", "check_downlink_bits", "check_topology"]
