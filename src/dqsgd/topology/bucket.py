"""The per-bucket protocol (sans-IO): shard split, encode, size caps, decode + aggregate, downlink.

See :mod:`dqsgd.topology` for one step written with it. Payloads are ``uint8`` tensors
(:mod:`dqsgd.topology.payloads`; ``bytes_tensor`` / ``tensor_bytes`` convert without a copy on CPU
where they can). Nothing here sends or waits: the engines (the trainer's transports, the DDP hook,
the FSDP reduce-scatter) move the payloads and call back.

Aggregation. The mean is ``Σ_w (1/W)·x̂_w`` in worker order: every payload is scaled before it is
added, so the mean of finite values stays finite (two ranks at 2e38 average to 2e38, not +inf). For
W a power of two the scaling is exact and the result is bitwise ``(Σ_w x̂_w)/W``. The majority vote
(``aggregate = "majority"``) is :func:`dqsgd.quantizers.majority_vote`.

Downlink. ``ps``: the server's aggregate in fp32 (:data:`FP32`); ``sharded``: each shard server's
aggregate at ``downlink_bits`` (stochastic max-norm rounding, or fp32); a vote is sent as its signs
(:data:`SIGN`) in every topology; ``allgather`` has no downlink (every rank aggregates).

Error-fed downlink (``downlink_feedback``, sharded, 2..16 bits): shard server j keeps the residual
e_j of its own rounding and rounds x = Ĝ_j + e_j instead of Ĝ_j, keeping e_j ← x − Q_d(x), as
DoubleSqueeze and 1-bit Adam do on their server leg. Q_d is then rounding to the nearest max-norm
level (:class:`~dqsgd.topology.downlink.Nearest`: |x_i − Q_d(x)_i| ≤ |x_i|, so the residual never
grows past what was to be sent; stochastic rounding under feedback diverged at 2 bits). What is sent
is no longer unbiased step by step, but nothing is lost: Σ_{n≤N} Q_d(x_n) = Σ_{n≤N} Ĝ_{j,n} − e_{j,N}
(e_{j,0} = 0), so the downlink's error does not accumulate (:meth:`BucketProtocol.encode_down_fed`).

Coded downlink (``downlink_coding``, :mod:`dqsgd.topology.downlink`): the same codes carried by an
entropy coding; payload sizes then vary, so a receiver takes each shard's exact bytes (the
engines exchange the sizes first) and the budget is charged the bytes really sent.

Keys (written once for the trainer, both transports, the hook and FSDP). Worker ``w``'s payload for
shard ``j`` (of ``shards``) of bucket ``bucket`` at step ``n`` rounds with the counter-based uniforms
``HashRNG(seed_for(seed, QUANT, bucket), n, w·shards + j)``; shard ``j``'s downlink with
``HashRNG(seed_for(seed, DOWNLINK, bucket), n, j)``; schemes that draw from a ``torch.Generator``
(TernGrad) use worker ``w``'s ``generator(seed, QUANT, w, bucket)``, drawn shard after shard. Bucket 0
is the trainer's whole model: ``seed_for`` ignores trailing zeros, so its keys are ``seed_for(seed,
QUANT)`` and ``generator(seed, QUANT, w)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Sequence

import torch

from dqsgd.core.rng import DOWNLINK, QUANT, seed_for
from dqsgd.core.sharding import shard_bounds, shard_sizes
from dqsgd.kernels import HashRNG
from dqsgd.topology import downlink, payloads
from dqsgd.topology.refusal import check_table
from dqsgd.topology.names import (
    DOWNLINK_PARITY_BITS, FP32, SAFE_DOWNLINK_BITS, check_auto_downlink)
from dqsgd.topology.registry import topology_of

if TYPE_CHECKING:
    from dqsgd.method.config import MethodConfig
    from dqsgd.method.pipeline import Method
    from dqsgd.policies.base import Spent
    from dqsgd.topology.downspec import DownlinkSpec

SIGN = payloads.SIGN


def uplink_seed(seed: int, bucket: int = 0) -> int:
    """The HashRNG seed of every uplink payload of ``bucket``."""
    return seed_for(seed, QUANT, bucket)


def downlink_seed(seed: int, bucket: int = 0) -> int:
    """The HashRNG seed of every downlink payload of ``bucket``."""
    return seed_for(seed, DOWNLINK, bucket)


def uplink_rng(useed: int, step: int, worker: int, shard: int, shards: int) -> HashRNG:
    """The uniforms of worker ``worker``'s payload for shard ``shard`` (``useed = uplink_seed(...)``)."""
    return HashRNG(useed, step, worker * shards + shard)


def downlink_rng(dseed: int, step: int, shard: int) -> HashRNG:
    """The uniforms of shard ``shard``'s downlink payload (``dseed = downlink_seed(...)``)."""
    return HashRNG(dseed, step, shard)


def worker_generator(seed: int, worker: int, bucket: int = 0) -> torch.Generator:
    """Worker ``worker``'s ``torch.Generator`` for ``bucket`` (schemes without hash uniforms)."""
    return torch.Generator().manual_seed(seed_for(seed, QUANT, worker, bucket))


def shard_methods(config: MethodConfig, numel: int, total_steps: int, param_sizes: Sequence[int],
                  shards: int) -> tuple[list[tuple[int, int]], list[Method]]:
    """The ``shards`` contiguous shards of a vector of ``numel`` coordinates and the method each is
    quantized with: a shard is a vector of its own (a bucket layout restarts at its start, a
    per-tensor layout is cut at its edges)."""
    from dqsgd.method.pipeline import Method

    bounds = shard_bounds(numel, shards)
    return bounds, [Method(config, hi - lo, total_steps, shard_sizes(param_sizes, lo, hi)) for lo, hi in bounds]


class BucketProtocol:
    """One bucket of ``numel`` coordinates (tensors of ``param_sizes``) under ``topology`` for ``workers``
    ranks. ``method``: the whole bucket's :class:`~dqsgd.method.pipeline.Method`, built from ``config``
    when not given; :attr:`policy` picks every shard's width (the method's policy, or under
    ``downlink_bits = "auto"`` its both-leg split, :meth:`_split`). ``spec``: the downlink as the run
    resolved it (:class:`~dqsgd.topology.downspec.DownlinkSpec`: width, coding, feedback, both-leg target),
    read as it is; without one, ``downlink_bits`` with every other option at its default (the coding: the
    uplink's where the downlink is quantized)."""

    def __init__(self, config: MethodConfig, numel: int, param_sizes: Sequence[int], *, topology: str,
                 workers: int, seed: int, total_steps: int, bucket: int = 0, downlink_bits: int | str = 8,
                 method: Method | None = None, spec: DownlinkSpec | None = None):
        from dqsgd.method.pipeline import Method
        from dqsgd.topology.downspec import downlink_of

        if spec is None:
            spec = downlink_of({"downlink_bits": downlink_bits, "allow_unsafe_downlink": True}, config, topology)

        self.kind = topology_of(topology)  # what the topology does (dqsgd.topology.registry)
        self.topology, self.workers, self.bucket = self.kind.name, workers, bucket
        self.method = method if method is not None else Method(config, numel, total_steps, param_sizes)
        count = self.kind.shards(workers)
        if numel < count:
            raise ValueError(f"topology sharded needs at least one coordinate per shard: {numel} coordinates "
                             f"for {workers} workers")
        if count == 1:  # the bucket is its one shard
            self.bounds, self.shards = [(0, numel)], [self.method]
        else:
            self.bounds, self.shards = shard_methods(config, numel, total_steps, param_sizes, count)
        self.vote = config.aggregate == "majority"
        self.auto = spec.auto
        if self.auto:
            check_auto_downlink(topology, self.vote, config.policy)
        width = DOWNLINK_PARITY_BITS if self.auto else spec.bits
        self.down_bits = SIGN if self.vote else (width if self.kind.sharded else FP32)
        self.down_coding = self.chosen_down = spec.coding
        self.coded_down = self.down_coding != downlink.FIXED
        self.useed, self.dseed = uplink_seed(seed, bucket), downlink_seed(seed, bucket)
        self._sizes: dict[int, list[int]] = {}
        if spec.feedback and self.down_bits in (FP32, SIGN):
            raise ValueError("downlink_feedback needs a quantized downlink: topology 'sharded', downlink_bits 2..16, "
                             "not a majority vote")
        self.feedback, self.down_target = spec.feedback, spec.target_bits
        # the bucket's bit policy: the method's, or under "auto" its both-leg split (whoever runs the bucket asks here)
        self.policy = self._split(total_steps) if self.auto else self.method.policy
        self.side_bits = 0  # the side traffic the policy pays every step (:meth:`charge_side`)

    def use_coding(self, coding: str) -> None:
        """The link policy's coding for the next step (its state's ``coding``): ``"fixed"`` sends every
        shard FIXED (the batched kernels), and the downlink too where it takes the uplink's ``auto``;
        another name, the configured codings. Lossless either way: the same decoded values."""
        from dqsgd.codecs import Coding

        fixed = coding == downlink.FIXED
        for m in {id(m): m for m in (self.method, *self.shards)}.values():
            m.coding = Coding.FIXED if fixed else Coding.from_name(m.config.coding)
        if self.chosen_down == "auto":
            self.down_coding = downlink.FIXED if fixed else self.chosen_down
            self.coded_down = self.down_coding != downlink.FIXED

    def charge_side(self, scatter: bool = False) -> None:
        """Make a budgeted policy pay what the exchange sends each step beyond its payloads, as far as its
        budget's legs go (:meth:`side_bytes`): the size tables in every engine alike (hook, trainer,
        simulation: the same widths), and FSDP's statistics (``scatter``), its entropy sample first cut to
        what the budget affords (:func:`~dqsgd.policies.coded.fit_sample`); the exchange adds them to each
        step's spent bits (tests/policies/test_coded_side.py checks them against the bytes handed over)."""
        from dqsgd.policies.budgeted import replace_budget
        from dqsgd.policies.coded import fit_sample
        from dqsgd.topology.scatter import ShardStats

        if scatter:
            self.policy = fit_sample(self.policy, lambda n: (self.workers - 1) * ShardStats(self, n).extra)
        side = 8 * self.side_bytes(scatter, charged=True)
        charged = replace_budget(self.policy, side_bits=side)
        if charged is not None:
            self.policy, self.side_bits = charged, side

    def side_bytes(self, scatter: bool = False, charged: bool = False) -> int:
        """Bytes one rank sends per step beyond its payloads and a fixed width's messages: the size table
        (S int64 to each peer) unless sizes are known in advance, a coded downlink's lengths (an int64 to each
        peer; ``charged``: where the budget counts the downlink), FSDP's statistics past the status room."""
        from dqsgd.topology.scatter import ShardStats

        peers = self.workers - 1
        sizes = 0 if payloads.fast_path(self.method) else 8 * len(self.shards) * peers
        down = self.kind.sharded and self.coded_down and not scatter and (self.auto or not charged)
        return sizes + (8 * peers if down else 0) + (peers * ShardStats(self).extra if scatter else 0)

    def _split(self, total_steps: int) -> Any:  # a SplitBudget, or the link policy choosing its downlink
        """The method's budgeted policy choosing both widths (:mod:`dqsgd.policies.split`): its budget is
        its uplink budget plus, over the run, an 8-bit fixed downlink's cost (a coded downlink spends
        less of it, and the policy buys wider roundings) or ``downlink_target_bits`` per coordinate and
        the downlink's headers, both legs counted as the ledger does. The link policy chooses both itself."""
        low = 2 if self.feedback else SAFE_DOWNLINK_BITS  # without feedback only widths that train safely
        if self.method.config.policy == "link":
            return self.method.policy.choosing_down(range(low, 17))
        from dqsgd.policies.split import split_budget
        down = tuple(range(low, 17))
        budget = self.method.budget_bits()
        if budget is None:
            raise ValueError(f"downlink_bits = 'auto' splits a budget between the legs: method "
                             f"{self.method.config.name!r} (policy {self.method.config.policy!r}) has none; use a "
                             f"budgeted policy (dqsgd, dqsgd-coded) or give an integer width")
        if self.down_coding not in (downlink.FIXED, "auto"):
            raise ValueError(f"downlink_bits = 'auto' with downlink_coding {self.down_coding!r}: a both-leg budget "
                             f"needs a downlink no larger than fixed: coding 'fixed' or 'auto'")
        headers = 8 * sum(self.down_sizes(low)) - low * self.numel  # the W payloads' headers (and byte padding)
        if self.down_target:
            budget += math.floor(total_steps * (headers + self.down_target * self.numel))
        else:
            budget += total_steps * 8 * sum(self.down_sizes(DOWNLINK_PARITY_BITS))
        return split_budget(self.method.policy, budget, lambda b: sum(m.message_bits(b) for m in self.shards), down,
                            tuple(8 * sum(self.down_sizes(v)) for v in down), self.workers, self.coded_down,
                            headers)

    @property
    def numel(self) -> int:
        return self.method.numel

    # --- keys and sizes -------------------------------------------------------------------------
    def uplink_rng(self, step: int, worker: int, shard: int) -> HashRNG:
        return uplink_rng(self.useed, step, worker, shard, len(self.shards))

    def downlink_rng(self, step: int, shard: int) -> HashRNG:
        return downlink_rng(self.dseed, step, shard)

    def caps(self, bits: int) -> list[int]:
        """The most bytes a valid payload for each shard can take at width ``bits``."""
        return [m.max_payload_bytes(bits) for m in self.shards]

    def check_sizes(self, table: Sequence[Sequence[int]], bits: int, who: str = "") -> None:
        """Refuse (PayloadError) ``table[w][j]`` above shard j's cap, before anything is allocated."""
        check_table(table, self.caps(bits), who)

    def down_sizes(self, dbits: int | None = None) -> list[int]:
        """Exact bytes of each shard's downlink payload at width ``dbits`` (None: the protocol's fixed
        width) (the cap of a downlink announcement)."""
        d = self.down_bits if dbits is None else dbits
        if d not in self._sizes:
            self._sizes[d] = [payloads.downlink_size(m, d) for m in self.shards]
        return self._sizes[d]

    def down_caps(self, dbits: int | None = None) -> list[int]:
        """The most bytes each shard's downlink payload can take at ``dbits``: :meth:`down_sizes` for
        the fixed downlink, a coding's bound for a coded one (what a receiver accepts)."""
        sizes = self.down_sizes(dbits)
        if not self.coded_down:
            return sizes
        d = self.down_bits if dbits is None else dbits
        return [downlink.downlink_cap(n, m.numel, d, self.down_coding) for n, m in zip(sizes, self.shards)]

    def down_width(self, policy: object) -> int:
        """The downlink width of the step whose policy state is ``policy``: its ``down_bits`` under
        ``downlink_bits = "auto"``, else the fixed width."""
        return int(getattr(policy, "down_bits")) if self.auto else self.down_bits

    def spent_bits(self, table: Sequence[Sequence[int]], dbits: int | None = None,
                   down: Sequence[int] | None = None) -> int:
        """The policy's spent bits of a step: the longest worker's uplink, all its shards together;
        under ``downlink_bits = "auto"`` also the W downlink payloads at ``dbits`` every worker
        receives: ``down[j]`` bytes (a coded downlink's real sizes), else their fixed sizes."""
        up = 8 * max(sum(row) for row in table)
        return up + self.down_spent(dbits, down) if self.auto else up

    def spent(self, table: Sequence[Sequence[int]], dbits: int | None, down: Sequence[int]) -> Spent:
        """What the policy is told a step cost (``down[j]``: the downlink payloads' real bytes):
        :meth:`spent_bits`, and under ``downlink_bits = "auto"`` with a coded downlink also the
        downlink's part of it (the split policy learns the coded / fixed ratio from it)."""
        if self.auto and self.coded_down:
            return self.spent_bits(table, dbits, down), self.down_spent(dbits, down)
        return self.spent_bits(table, dbits)

    def down_spent(self, dbits: int | None = None, down: Sequence[int] | None = None) -> int:
        """Bits of the W downlink payloads one worker receives: ``down[j]`` bytes each, else the fixed sizes."""
        return 8 * sum(self.down_sizes(dbits) if down is None else down)

    # --- uplink leg -----------------------------------------------------------------------------
    def local_scalers(self, flat: torch.Tensor) -> torch.Tensor:
        """TernGrad: the scalers of every shard's segments, concatenated (max-reduced as one tensor)."""
        return torch.cat([m.local_scalers(flat[lo:hi]) for m, (lo, hi) in zip(self.shards, self.bounds)])

    def split_scalers(self, scalers: torch.Tensor | None) -> list[torch.Tensor | None]:
        if scalers is None:
            return [None] * len(self.shards)
        return list(torch.split(scalers, [m.layout.num_segments(m.numel) for m in self.shards]))

    def encode(self, worker: int, flat: torch.Tensor, bits: int, step: int, generator: torch.Generator | None,
               residuals: Sequence[torch.Tensor | None] | None = None,
               scalers: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Worker ``worker``'s payload for every shard (``uint8`` tensors on ``flat``'s device) and the
        shards' new error-feedback residuals; ``residuals[j]``: shard j's memory (None: none yet);
        ``scalers``: TernGrad's max-reduced :meth:`local_scalers`."""
        from dqsgd.quantizers import NonFiniteGradientError

        res_in = residuals if residuals is not None else [None] * len(self.shards)
        if scalers is None and all(r is None for r in res_in):  # every shard in one batched call
            try:
                got = payloads.encode_batched(self.shards, self.bounds, flat, bits,
                                              [self.uplink_rng(step, worker, j) for j in range(len(self.shards))])
            except NonFiniteGradientError as e:
                raise self.nonfinite(e, step, worker) from None
            if got is not None:
                buf, at, sizes = got
                return [buf[a : a + n] for a, n in zip(at, sizes)], [None] * len(self.shards)
        out, res = [], []
        for j, (m, (lo, hi), sc) in enumerate(zip(self.shards, self.bounds, self.split_scalers(scalers))):
            try:
                p, r = payloads.encode_shard(m, flat[lo:hi], bits, self.uplink_rng(step, worker, j), generator,
                                             res_in[j], sc)
            except NonFiniteGradientError as e:
                e.shard = j  # type: ignore[attr-defined]
                raise self.nonfinite(e, step, worker) from None
            out.append(p)
            res.append(r)
        return out, res

    def nonfinite(self, err: Exception, step: int, worker: int) -> Exception:
        """The quantizer's refusal of a non-finite input, naming the step, the worker and the shard."""
        from dqsgd.quantizers import NonFiniteGradientError

        where = f", shard {getattr(err, 'shard', 0)}" if len(self.shards) > 1 else ""
        return NonFiniteGradientError(f"step {step}, worker {worker}{where}: {err}")

    def reduce(self, shard: int, received: Sequence[torch.Tensor], bits: int, voters: list[bool] | None = None,
               out: torch.Tensor | None = None, bad: torch.Tensor | None = None) -> torch.Tensor:
        """Decode and aggregate shard ``shard`` from the workers' payloads (worker order): the mean,
        each of the n payloads scaled by 1/n before it is added, or the majority vote (``voters``: who
        votes). n is W, or fewer when a server averages only the first arrivals (backup workers).
        ``out``: a float32 buffer the result is written into (its contents are not used); ``bad``:
        deferred validation (device)."""
        m = self.shards[shard]
        if not 0 < len(received) <= self.workers:
            raise ValueError(f"shard {shard}: {len(received)} payloads for {self.workers} workers")
        if self.vote:
            v = payloads.vote(m, list(received), bits, voters)
            return v if out is None else out.copy_(v)
        if out is None:
            out = torch.empty(m.numel, dtype=torch.float32, device=received[0].device)
        payloads.accumulate(m, list(received), bits, out, bad, weight=1.0 / len(received), fresh=True)
        return out

    # --- downlink leg ---------------------------------------------------------------------------
    def encode_down(self, shard: int, avg: torch.Tensor, step: int, size: int | None = None,
                    dbits: int | None = None) -> torch.Tensor:
        """Shard ``shard``'s downlink payload (exactly ``down_sizes(dbits)[shard]`` bytes; a coded one at
        most ``down_caps(dbits)[shard]``), zero-padded to ``size`` bytes when given (an all-gather's
        equal sizes; written in place on the CPU codec). ``dbits``: the step's width (:meth:`down_width`;
        None: the fixed width)."""
        m, rng, d = self.shards[shard], self.downlink_rng(step, shard), self._width(dbits)
        want = self.down_sizes(d)[shard]
        if self.coded_down:
            pay = downlink.encode_coded(m, avg, d, self.down_coding, None if self.feedback else rng)
            n = pay.numel()
            if n > self.down_caps(d)[shard]:
                raise RuntimeError(f"shard {shard}: coded downlink payload of {n} bytes, over its cap")
            return pay if size is None else payloads.pad(pay, max(size, n))
        if self.feedback:  # rounded to nearest: the residual keeps the rest (encode_down_fed)
            pay = downlink.encode_coded(m, avg, d, downlink.FIXED, None)
            n = pay.numel()
            pay = pay if size is None else payloads.pad(pay, max(size, n))
        elif size is None:
            pay = payloads.encode_downlink(m, avg, d, rng)
            n = pay.numel()
        else:
            pay, n = payloads.encode_downlink_padded(m, avg, d, rng, size)
        if n != want:
            raise RuntimeError(f"shard {shard}: downlink payload of {n} bytes, predicted {want}")
        return pay

    def encode_down_fed(self, shard: int, avg: torch.Tensor, step: int, residual: torch.Tensor | None,
                        size: int | None = None, bad: torch.Tensor | None = None,
                        dbits: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Shard ``shard``'s downlink payload and the shard server's new residual.

        Without feedback: :meth:`encode_down` of ``avg`` and None. With it (``residual``: e_j, None
        at the first step = zeros): the payload of x = avg + e_j and e_j' = x − Q_d(x), where Q_d(x)
        is what every rank decodes from that payload (so Q_d(x) + e_j' = x up to one float32
        rounding of the difference; exactly where Q_d(x) and x are within a factor 2: Sterbenz).
        ``bad``: deferred validation of the decode (device path, as :meth:`decode_down`)."""
        if not self.feedback:
            return self.encode_down(shard, avg, step, size, dbits), None
        x = avg if residual is None else avg + residual.to(avg.device)
        pay = self.encode_down(shard, x, step, size, dbits)
        sent = torch.zeros_like(x)
        self._decode_shard(shard, pay, sent, bad, self._width(dbits))
        return pay, x - sent

    def decode_down(self, received: Sequence[torch.Tensor], out: torch.Tensor | None = None,
                    bad: torch.Tensor | None = None, dbits: int | None = None) -> torch.Tensor:
        """The update from every shard's downlink payload (shard order; a fixed one may be padded, a
        coded one is its exact bytes): the same bytes give the same update on every rank. ``out``: the
        float32 buffer the update is written into (its contents are not used; None: a new one);
        ``bad``: deferred validation (device); ``dbits``: the step's width (None: the fixed width)."""
        if len(received) != len(self.shards):
            raise ValueError(f"{len(received)} downlink payloads for {len(self.shards)} shards")
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float32, device=received[0].device)
        d = self._width(dbits)
        if not self.coded_down and d not in (FP32, SIGN):  # every shard in one batched call
            from dqsgd.quantizers import Norm

            spec = [(m.numel, m.layout) for m in self.shards]
            if payloads.accumulate_batch(spec, d, Norm.MAX, received, out, [lo for lo, _ in self.bounds], 1.0, bad,
                                         lambda o: self._decode_each(received, o, None, d), padded=True, fresh=True):
                return out
        self._decode_each(received, out.zero_(), bad, d)
        return out

    def _decode_each(self, received: Sequence[torch.Tensor], out: torch.Tensor, bad: torch.Tensor | None,
                     dbits: int) -> None:
        for j, ((lo, hi), p) in enumerate(zip(self.bounds, received)):
            self._decode_shard(j, p, out[lo:hi], bad, dbits)

    def _width(self, dbits: int | None) -> int:
        if dbits is None:
            if self.auto:
                raise ValueError("downlink_bits = 'auto': the step's downlink width must be given (down_width)")
            return self.down_bits
        if dbits != self.down_bits and not self.auto:
            raise ValueError(f"downlink width {dbits} given to a protocol of fixed width {self.down_bits}")
        return dbits

    def _decode_shard(self, j: int, p: torch.Tensor, out: torch.Tensor, bad: torch.Tensor | None,
                      dbits: int | None = None) -> None:
        """``out += `` shard j's downlink payload ``p`` (fixed: maybe padded) at width ``dbits``, validated."""
        from dqsgd.method.pipeline import ProtocolError
        from dqsgd.quantizers import Norm

        from dqsgd.codecs import PayloadError

        dbits = self._width(dbits)
        if self.coded_down:  # a refusal names the shard and the rank that serves it (rank j)
            where = f"the coded downlink of shard {j} from rank {j} (its server)"
            try:
                downlink.decode_coded(p, out, dbits, self.shards[j], lambda text: ProtocolError(f"{where}: {text}"))
            except PayloadError as e:
                raise PayloadError(f"{where}: {e}") from None
            return
        n, numel = self.down_sizes(dbits)[j], out.numel()
        uniform = dbits not in (FP32, SIGN)
        expect = (dbits, Norm.MAX, self.shards[j].layout) if uniform else None
        h = payloads.decode_accumulate_payload(p[:n], out, max_numel=max(numel, 1), expect=expect,
                                               bad=bad if uniform else None)
        if h.numel != numel:
            raise ProtocolError(f"shard {j}'s downlink payload holds {h.numel} values, the shard {numel}")


def replace_kernel(config: MethodConfig, kernel: str) -> MethodConfig:
    """``config`` with ``kernel`` where its quantizer has that kernel (the hook's hash uniforms)."""
    return dataclasses.replace(config, kernel=kernel) if config.quantizer.fused and config.kernel != kernel else config
