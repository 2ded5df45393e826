"""A DDP communication hook that sends dqsgd-quantized gradients (PyTorch's comm-hook style).

    model = DistributedDataParallel(net)
    state = dqsgd.ddp.HookState(method="dqsgd", process_group=None)
    model.register_comm_hook(state, dqsgd.ddp.hook)
    ...                                   # train as usual
    print(state.compression_stats())      # measured bytes sent and received, and the ratios

**Asynchronous.** The hook hands the bucket to its exchange (:mod:`dqsgd.topology.exchange`, the
one the trainer runs), which encodes it, issues its collectives with ``async_op=True`` and returns
a future; decoding and averaging run when the collectives complete, so a bucket's communication
overlaps the backward of the buckets after it. Fixed-width (FIXED-coded) payloads have a size that
follows from (numel, bits), so no sizes are exchanged; variable-length codings (Elias, rANS, zstd)
exchange their sizes first in one small all-gather, whose completion issues the payloads' collective.

**Topology ``sharded``** (the default): for W ranks the bucket's flat gradient is cut into W
contiguous shards (:func:`dqsgd.core.sharding.shard_bounds`), each quantized as a vector of its own;
one ``all_to_all`` sends shard j to rank j; rank j decodes the W payloads of its shard and
averages them (G_j = Σ_w (1/W)·Q(g_w,j)), quantizes G_j for the downlink — unbiased stochastic
max-norm rounding at ``downlink_bits`` (default 8; for the budgeted methods ``dqsgd`` and
``dqsgd-coded`` ``"auto"``: the policy chooses both legs' widths from one budget,
:mod:`dqsgd.policies.split`) with hash uniforms of
``HashRNG(seed_for(seed, DOWNLINK, bucket), step, j)``, or ``"fp32"`` — and one all-gather
delivers every averaged shard to every rank. Then E[Q_down(G)] = E[G] = mean gradient (both
roundings are unbiased and independent), and each rank moves ≈ 2·(W−1)/W·n·b/8 bytes per step
plus headers, whatever W. Topology ``"allgather"``: every rank receives all W payloads of the
whole bucket and decodes them all ((W−1)·n·b/8 bytes each way).

**Widths.** A bucket index has one policy; it observes the reconstructed averaged bucket that
every rank holds after the last collective — bitwise the same bytes on every rank — so every
rank picks the same next width with no extra collective. On a CPU bucket the width of step n+1
comes from step n. On a device (CUDA) the statistics are read on the host one step late (the width
of step n+1 comes from step n−1), so that reading them never waits for the GPU.
The link policy (``dqsgd-link``) also needs every rank's ‖g‖²: each rank adds it, with its own
rounding's realized error, to the all-gather of its payload sizes (float64 bits), so every rank folds
the same σ̂²; where it prices the dtype faster than the codec it sends the bucket uncompressed, as the
plain all-reduce (``uncompressed_dtype``: in fp16 or bf16) — docs/ddp-hook.md, "The link policy".

**Randomness.** Uniform quantization always uses the counter-based hash uniforms (kernel
"fused", whatever ``config.kernel`` says): rank r's payload for shard j of bucket b at step n
rounds with ``HashRNG(seed_for(seed, QUANT, b), n, r·S + j)`` (S shards: W, or 1 for allgather),
so a CPU and a GPU produce the same bytes. TernGrad rounds with a per-(rank, bucket)
``torch.Generator``. These are the trainer's keys (bucket 0 is its whole model): the hook runs the
trainer's per-bucket protocol (:mod:`dqsgd.topology`), and a model whose gradient is one bucket
gives the trainer's bytes and parameters bit for bit.

**Codec placement.** Uniform FIXED payloads are encoded and decoded on the bucket's device (CPU:
the fused numba kernels; CUDA: the device codec ``dqsgd.kernels.device``). Sign, ternary and
identity schemes, error feedback and entropy codings use the host path (encode on the CPU).

**AMP.** A rank whose bucket holds NaN/Inf encodes it with those entries zeroed and raises a flag
byte that travels with its payload; every rank then returns an all-NaN bucket, so
``torch.amp.GradScaler`` skips the step and lowers its scale on every rank, as it does without the
hook. The policy does not observe such a step.

**signSGD.** The trainer's majority vote (ties → +1, sent as 1-bit signs); a rank whose bucket is
all zeros abstains, and a bucket nobody votes on stays zero. The update is lr·sign(·) per
coordinate, so use a small lr (around 1e-4).

**Errors.** A rank that announces a payload larger than the method can produce is refused before
anything is allocated (PayloadError, on every rank); ranks whose configurations differ raise
RankDisagreement naming the fields at the first call; a payload that fails validation raises its
PayloadError from ``backward()`` on every rank. A GradScaler-skipped step changes no method state.

**Also.** ``start_iter``: the first backward passes are plain all-reduces (like
``start_powerSGD_iter``); ``min_compression_rate``: a bucket whose predicted ratio is below it (and
any bucket with fewer elements than ranks) is all-reduced as is; world size 1 returns the gradient
untouched. ``HookState.state_dict()``/``load_state_dict()`` checkpoint policies (the DQSGD budget
ledger), residuals, generators and counters; pickling drops the process group. DDP rebuilds its
buckets after the first iteration; a bucket index whose size changes gets a fresh policy.
"""

from dqsgd.ddp.comm_hook import hook
from dqsgd.ddp.state import CompressionStats, HookState

__all__ = ["CompressionStats", "HookState", "hook"]
