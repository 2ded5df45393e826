"""The asynchronous DDP communication hook (topologies ``sharded`` and ``allgather``).

The hook encodes the bucket, issues its collective with ``async_op=True`` and returns a future at
once; decoding and averaging run when the collective completes, while autograd goes on with the
backward of the next buckets. Collectives run on two process groups of the hook (with its
timeout): the uplink group gets the collectives issued by the hook itself, in bucket order; the
downlink group gets the sharded all-gathers, issued from completion callbacks in bucket order
(each waits until the previous bucket's is issued): two groups, so both orders are the same on
every rank whatever the order in which collectives complete.

What is sent, the keys, the size caps, the aggregation and the downlink are the bucket's
:class:`dqsgd.topology.bucket.BucketProtocol`, the one the trainer runs; this module keeps what is
DDP's: buckets, futures, the two process groups and the deferred device checks. A message is a
payload and one flag byte (:mod:`dqsgd.topology.payloads`); a sharded downlink message is a payload
padded to the longest and one status byte: 0, or 1 when its shard server refused a payload (the
payload area then holds the error's text), so that every rank raises the same error. A coded
downlink (``downlink_coding``) sends each shard's exact payload and that status byte, with the
lengths exchanged first (:mod:`dqsgd.ddp.varlen`).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time
# (bucket: dist.GradBucket, return: torch.futures.Future[torch.Tensor]).
import threading
import warnings
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from dqsgd.ddp.state import HookState, BucketState, ring_bytes
from dqsgd.topology import payloads as codec
from dqsgd.topology.registry import ALLGATHER, SHARDED, topology_of

Finish = Callable[[], torch.Tensor]
Stage2 = Any  # (future of the last collective, Finish, future: its collectives are issued, or None)
_COUNT_LOCK = threading.Lock()  # the coded downlink's traffic is counted from a completion callback


def _count(state: HookState, *args: int) -> None:
    with _COUNT_LOCK:
        state.count(*args)


def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Quantize, exchange, decode and average one gradient bucket (``register_comm_hook``)."""
    grad = bucket.buffer()
    _raise_at_end_of_backward(state)
    try:
        fut = _dispatch(state, bucket, grad)
        if state._queued:
            state._futures.append(fut)
        return fut
    finally:
        if bucket.is_last():
            state.iter += 1
            state.steps += 1


def _dispatch(state: HookState, bucket: dist.GradBucket, grad: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    pg = state.process_group or dist.group.WORLD
    world = dist.get_world_size(pg)
    if world == 1:  # nothing to send: the gradient as it is (no quantization noise, no traffic)
        return _completed(grad)
    state.agree()  # first call: every rank runs the same configuration (else all raise, naming the fields)
    if state.iter < state.start_iter or grad.numel() < world:
        return _allreduce(state, grad, world)
    rank = dist.get_rank(pg)
    b = state.bucket(bucket.index(), grad, [p.numel() for p in bucket.parameters()], rank, world)
    if b.step == state.total_steps and state.config.dynamic:  # the first step past the horizon N
        warnings.warn(f"dqsgd hook: step {b.step} is past total_steps = {state.total_steps}, the horizon of the "
                      f"{state.config.name} policy; it keeps its last choice from now on (pass total_steps = the "
                      "number of training steps to HookState)", RuntimeWarning, stacklevel=2)
    b.check_payloads(bucket.index())  # deferred validation of what this rank decoded earlier
    b.catch_up(b.step - 1 - (0 if grad.device.type == "cpu" else 1))  # device: statistics one step late
    if not _worth_it(state, b, grad.element_size()):
        return _allreduce(state, grad, world)
    payloads, flags, send = _encode_flagged(state, b, grad, rank)
    if topology_of(state.topology).sharded:
        return _sharded(state, b, grad, payloads, flags, send, rank, world)
    return _allgather(state, b, grad, payloads[0], flags, send, rank, world)


def _completed(t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


def _allreduce(state: HookState, grad: torch.Tensor, world: int) -> torch.futures.Future[torch.Tensor]:
    """Plain mean all-reduce in the bucket's dtype (warm-up, small buckets), counted as a ring."""
    up, _ = state.groups()
    nbytes = grad.numel() * grad.element_size()
    _count(state, ring_bytes(nbytes, world), ring_bytes(nbytes, world), grad.numel(), grad.element_size(),
                8 * grad.element_size(), world)
    work = dist.all_reduce(grad.div_(world), group=up, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


def _worth_it(state: HookState, b: BucketState, itemsize: int) -> bool:
    """Predicted ratio (bytes in the bucket's dtype / uplink payload bytes) ≥ min_compression_rate."""
    payload = b.uplink_bytes(b.width())
    return b.numel * itemsize >= state.min_compression_rate * payload


def _encode_flagged(state: HookState, b: BucketState, grad: torch.Tensor,
                    rank: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """Every shard's payload, this rank's flag byte, and (CPU fast path, see
    :func:`codec.encode_messages`) the send buffer that holds them both, else None; NaN/Inf entries
    are encoded as 0 and flagged.

    CPU: the encoders refuse a non-finite input from the norms they compute anyway, so the
    common case costs no extra pass; on a refusal the zeroed bucket is encoded again. Device (and
    TernGrad, whose scalers are all-reduced before encoding): the bucket is zeroed where
    non-finite first, and the flag stays a device tensor (no host sync). New error-feedback
    residuals are staged and kept only if no rank flags a non-finite bucket (:func:`_finish`).
    """
    from dqsgd.quantizers import NonFiniteGradientError

    flat = grad.detach().reshape(-1).to(torch.float32)
    majority = b.proto.vote
    if flat.device.type != "cpu" or b.method.shares_scalers:
        finite = torch.isfinite(flat)
        flat = torch.where(finite, flat, torch.zeros((), dtype=flat.dtype, device=flat.device))
        flags = (~finite.all()).to(torch.uint8)
        if majority:
            flags = flags | ((flat == 0).all().to(torch.uint8) * codec.FLAG_ZERO)
        return _encode(state, b, flat, rank), flags.reshape(1), None
    bad = 0
    try:
        encoded = _encode_cpu(state, b, flat, rank)
    except NonFiniteGradientError:
        bad = codec.FLAG_NONFINITE
        flat = torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0)
        encoded = _encode_cpu(state, b, flat, rank)
    zero = codec.FLAG_ZERO if majority and not flat.any() else 0
    flags = torch.tensor([bad | zero], dtype=torch.uint8)
    if isinstance(encoded, list):
        return encoded, flags, None
    send, sizes = encoded
    return codec.set_flags(send, sizes, bad | zero), flags, send


def _encode_cpu(state: HookState, b: BucketState, flat: torch.Tensor,
                rank: int) -> list[torch.Tensor] | tuple[torch.Tensor, list[int]]:
    """Every shard's payload: written in place into the send buffer where
    :func:`codec.encode_messages` applies (then the buffer and the payload sizes), else a list."""
    rngs = [b.proto.uplink_rng(b.step, rank, j) for j in range(len(b.shards))]
    encoded = codec.encode_messages(b.shards, b.bounds, flat, b.bits, rngs)
    return _encode(state, b, flat, rank) if encoded is None else encoded


def _encode(state: HookState, b: BucketState, flat: torch.Tensor, rank: int) -> list[torch.Tensor]:
    """This rank's payload for every shard (:meth:`BucketProtocol.encode`); new residuals staged."""
    scalers = _shared_scalers(state, b, flat) if b.method.shares_scalers else None
    residuals = [b.residuals.get(j) for j in range(len(b.shards))]
    out, res = b.proto.encode(rank, flat, b.bits, b.step, b.generator, residuals, scalers)
    b.staged = {j: r for j, r in enumerate(res) if r is not None} or None
    return out


def _shared_scalers(state: HookState, b: BucketState, flat: torch.Tensor) -> torch.Tensor:
    """TernGrad: every shard's per-tensor scalers, max-reduced over ranks (one blocking all-reduce)."""
    joined = b.proto.local_scalers(flat.cpu())
    dist.all_reduce(joined, op=dist.ReduceOp.MAX, group=state.groups()[0])
    return joined


def _finish(state: HookState, b: BucketState, out: torch.Tensor, flags: torch.Tensor, step: int, spent: int,
            grad: torch.Tensor) -> torch.Tensor:
    """NaN everywhere if any rank overflowed (then no method state changes: staged residuals, the
    uplink's and the error-fed downlink's, are dropped, the policy skips the step); a vote nobody
    cast stays 0; cast to the bucket's dtype. The first such step is said once (a warning)."""
    bad = (flags & codec.FLAG_NONFINITE).any().to(torch.bool)  # uint8 flags: any() keeps their dtype
    if b.staged is not None:
        if not bool(bad):
            b.residuals.update(b.staged)
        b.staged = None
    if b.down_staged is not None:  # selected on the device: no host sync
        old = b.down_residual if b.down_residual is not None else torch.zeros_like(b.down_staged)
        b.down_residual, b.down_staged = torch.where(bad.to(old.device), old, b.down_staged), None
    if b.proto.vote:
        out = torch.where((flags & codec.FLAG_ZERO).all(), torch.zeros((), device=out.device), out)
    if b.method.config.dynamic:
        b.record(out, step, spent, bad)
    if out.device.type == "cpu":
        if bool(bad):
            _say_nonfinite(state, step)
            out.fill_(float("nan"))
    else:
        out = torch.where(bad, torch.full((), float("nan"), device=out.device), out)
    return out.to(grad.dtype).reshape(grad.shape)


def _say_nonfinite(state: HookState, step: int) -> None:
    """Warn once per HookState, naming the step, that a rank's bucket held NaN or Inf."""
    if state.nonfinite_step is not None:
        return
    import warnings

    state.nonfinite_step = step
    warnings.warn(f"dqsgd hook: step {step} (the bucket's compressed step): some rank's gradient bucket holds NaN or "
                  "Inf, so every rank gets NaN for it (a GradScaler skips such a step). If the loss stays non-finite "
                  "the run has diverged: lower the lr, or raise downlink_bits or set downlink_feedback=True. "
                  "Said once.", RuntimeWarning, stacklevel=2)


def _average(b: BucketState, shard: int, payloads: list[torch.Tensor], flags: torch.Tensor, bits: int,
             device: torch.device) -> torch.Tensor:
    """Shard ``shard`` aggregated from the ranks' payloads (:meth:`BucketProtocol.reduce`), float32 on ``device``."""
    if b.proto.vote:
        voters = [not f & codec.FLAG_ZERO for f in flags.cpu().tolist()]
        return b.proto.reduce(shard, payloads, bits, voters).to(device)
    out = torch.zeros(b.shards[shard].numel, dtype=torch.float32, device=device)
    return b.proto.reduce(shard, payloads, bits, out=out, bad=b.payload_flag(out))


def _allgather(state: HookState, b: BucketState, grad: torch.Tensor, payload: torch.Tensor, flags: torch.Tensor,
               send: torch.Tensor | None, rank: int, world: int) -> torch.futures.Future[torch.Tensor]:
    """Topology ``allgather``: every rank receives all W messages and decodes them all."""
    up, _ = state.groups()
    table = _sizes(up, [payload.numel()], codec.fast_path(b.method), world)
    b.proto.check_sizes(table, b.bits, f"rank {rank}: bucket {b.numel} elements: ")
    sizes = [row[0] for row in table]
    size = max(sizes) + 1
    msg = send if send is not None and send.numel() == size else torch.cat([codec.pad(payload, size - 1),
                                                                             flags.reshape(1)])
    gathered = [torch.empty_like(msg) for _ in range(world)]
    _count(state, *ALLGATHER.rank_traffic([[n + 1] for n in sizes], [], rank), b.numel, grad.element_size(),
                b.width(), world)
    bits, step, spent = b.bits, b.step, b.proto.spent_bits(table)
    b.step += 1
    work = dist.all_gather(gathered, msg, group=up, async_op=True)

    def decode_and_average(fut: torch.futures.Future) -> torch.Tensor:
        try:
            fut.wait()
            flg = torch.stack([g[-1] for g in gathered])
            avg = _average(b, 0, [g[:n] for g, n in zip(gathered, sizes)], flg, bits, grad.device)
            return _finish(state, b, avg, flg, step, spent, grad)
        except Exception as e:  # noqa: BLE001 - raised, with its type, at the end of backward()
            out = _failed(state, e, grad)
            if out is None:
                raise
            return out

    return work.get_future().then(decode_and_average)


def _sizes(group: dist.ProcessGroup, mine: list[int], fixed: bool, world: int) -> list[list[int]]:
    """Every rank's payload sizes (W rows of len(mine)): known without a collective for fixed widths,
    where every rank's are the same; else one small blocking all-gather (variable-length codings)."""
    if fixed:
        return [mine] * world
    t = torch.tensor(mine, dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    return torch.stack(out).tolist()


def _sharded(state: HookState, b: BucketState, grad: torch.Tensor, payloads: list[torch.Tensor], flags: torch.Tensor,
             send: torch.Tensor | None, rank: int, world: int) -> torch.futures.Future[torch.Tensor]:
    """Topology ``sharded``: all-to-all of shard payloads, rank j aggregates shard j, encodes it for
    the downlink and one all-gather delivers every shard's downlink message to every rank."""
    up, down = state.groups()
    mine = [p.numel() for p in payloads]
    table = _sizes(up, mine, codec.fast_path(b.method), world)  # table[w][j]: rank w's payload for shard j
    b.proto.check_sizes(table, b.bits, f"rank {rank}: bucket {b.numel} elements: ")
    send_sizes, recv_sizes = [n + 1 for n in mine], [row[rank] + 1 for row in table]
    send = codec.messages(payloads, flags) if send is None else send
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=grad.device)
    dbits = b.proto.down_width(b.policy)  # downlink_bits "auto": the policy's width for this step
    coded = b.proto.coded_down
    dmsg = max(b.proto.down_sizes(dbits)) + 1  # the longest downlink payload and the status byte
    _count(state, *SHARDED.rank_traffic([[n + 1 for n in row] for row in table], [0 if coded else dmsg] * world,
                                rank), b.numel, grad.element_size(), b.width(), world)
    bits, step, spent = b.bits, b.step, b.proto.spent_bits(table, dbits)
    b.step += 1
    work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=up, async_op=True)

    def reduce_shard() -> Stage2:
        from dqsgd.codecs import PayloadError
        from dqsgd.method.pipeline import ProtocolError

        msgs = recv.split(recv_sizes)
        flg = recv[torch.tensor(recv_sizes).cumsum(0) - 1]  # the flag byte ending each message
        try:
            avg = _average(b, rank, [msg[:-1] for msg in msgs], flg, bits, grad.device)
            mine_down, b.down_staged = b.proto.encode_down_fed(rank, avg, step, b.down_residual,
                                                               None if coded else dmsg, b.payload_flag(avg), dbits)
            if coded:  # its exact bytes and the status byte 0 (fixed: zero padded, the last byte 0)
                mine_down = torch.cat([mine_down, torch.zeros(1, dtype=torch.uint8, device=mine_down.device)])
        except (PayloadError, ProtocolError) as e:  # tell every rank, in the downlink itself
            mine_down = _failure(e, b.proto.down_caps(dbits)[rank] + 1 if coded else dmsg, grad.device)
        if coded:
            return _coded_down(state, b, mine_down, flg, step, table, grad, dbits, rank, world)
        gathered = [torch.empty_like(mine_down) for _ in range(world)]
        return dist.all_gather(gathered, mine_down, group=down, async_op=True).get_future(), \
            lambda: _assemble(state, b, gathered, flg, step, spent, grad, dbits), None

    return _ordered(state, work.get_future(), reduce_shard, grad)


def _coded_down(state: HookState, b: BucketState, mine: torch.Tensor, flags: torch.Tensor, step: int,
                table: List[List[int]], grad: torch.Tensor, dbits: int, rank: int, world: int) -> Stage2:
    """The coded downlink: this rank's exact message all-gathered with the others' (lengths first);
    its traffic counted and the step's spend known once the lengths are."""
    from dqsgd.ddp.varlen import all_gather_varlen
    from dqsgd.topology.limits import check_sizes

    caps, got = b.proto.down_caps(dbits), {}

    def on_sizes(lengths: List[int]) -> None:
        for j, n in enumerate(lengths):  # rank j serves shard j
            check_sizes([n - 1], [caps[j]], f"rank {rank}: the coded downlink of bucket {b.numel}: rank {j} (the "
                                            f"server of shard {j})")
        down = SHARDED.wire_traffic([[0] * world for _ in range(world)], lengths)[1][rank]
        _count(state, down, down, 0, 0, 0, world)
        got["spent"] = b.proto.spent(table, dbits, [n - 1 for n in lengths])

    fut, issued = all_gather_varlen(mine, state.groups()[1], world, on_sizes)  # fails with the refusal's own type

    def finish() -> torch.Tensor:
        gathered, lengths = fut.value()
        return _assemble(state, b, gathered, flags, step, got["spent"], grad, dbits, lengths)

    return fut, finish, issued


def _failure(err: Exception, size: int, device: torch.device) -> torch.Tensor:
    """A downlink message saying that this shard server refused a payload: the error's text, status 1."""
    text = f"{type(err).__name__}: {err}".encode()[: size - 1]
    msg = codec.bytes_tensor(text, device, size)
    msg[-1] = 1
    return msg


def _assemble(state: HookState, b: BucketState, gathered: list[torch.Tensor], flags: torch.Tensor, step: int, spent: Any,
              grad: torch.Tensor, dbits: int, lengths: Optional[List[int]] = None) -> torch.Tensor:
    """Decode every shard server's downlink into the bucket (the same bytes on every rank). A shard
    server that refused a payload: every rank raises its error (CPU) or flags the bucket (device).
    ``lengths``: each message's length (a coded downlink; else every message is padded alike)."""
    from dqsgd.codecs import PayloadError
    from dqsgd.method.pipeline import ProtocolError

    out = torch.zeros(b.numel, dtype=torch.float32, device=grad.device)
    flag = b.payload_flag(out)
    if lengths is not None:  # each message's own status byte, then its exact payload
        gathered = [g[:n] for g, n in zip(gathered, lengths)]
    status = torch.stack([g[-1] for g in gathered])
    if flag is None:
        for j in [j for j, v in enumerate(status.tolist()) if v]:
            kind, _, text = codec.tensor_bytes(gathered[j][:-1]).rstrip(b"\0").decode(errors="replace").partition(": ")
            raise (ProtocolError if kind == "ProtocolError" else PayloadError)(
                f"step {step}: rank {j} (the server of shard {j}) refused a payload: {text}")
    else:
        flag |= (status != 0).any()
    b.proto.decode_down([g[:-1] for g in gathered], out, flag, dbits)
    return _finish(state, b, out, flags, step, spent, grad)


def _raise_at_end_of_backward(state: HookState) -> None:
    """Once per backward pass: queue a callback of the autograd engine, run after DDP has waited for
    every bucket, that raises the first error a bucket's callback met (a refused payload), with its
    own type, to backward()'s caller. A future that fails instead reaches the caller as a
    RuntimeError that has lost the type; a failed bucket's future holds NaN."""
    if state._queued:
        return

    def end() -> None:
        futures, state._futures = state._futures, []
        for f in futures:  # the engine may run this before DDP waits for the buckets
            try:
                f.wait()
            except Exception:  # noqa: BLE001 - a failed future raises in DDP's own wait
                pass
        state._queued = False
        err, state._error = state._error, None
        if err is not None:
            raise err

    try:
        torch.autograd.Variable._execution_engine.queue_callback(end)
    except RuntimeError:  # called outside a backward pass (a direct call): errors stay in the futures
        return
    state._queued = True


def _failed(state: HookState, err: Exception, grad: torch.Tensor) -> torch.Tensor | None:
    """Keep ``err`` for the end of backward() (the first one) and give DDP a NaN bucket meanwhile;
    None where no end-of-backward callback is queued (the future must fail)."""
    if not state._queued:
        return None
    if state._error is None:
        state._error = err
    return torch.full_like(grad, float("nan"))


def _fail(result: torch.futures.Future, state: HookState, err: Exception, grad: torch.Tensor) -> None:
    out = _failed(state, err, grad)
    if out is None:
        result.set_exception(err)
    else:
        result.set_result(out)


def _ordered(state: HookState, first: torch.futures.Future, stage2: Callable[[], Stage2],
             grad: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Run ``stage2`` once ``first`` is done and the previous bucket's stage 2 has issued its
    collectives (stage 2 gives the future of its last collective, ``finish``, and a future that
    completes once its collectives are issued, or None: already); the returned future holds
    ``finish()`` after stage 2's collective completes."""
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    prev, issued = state._issued, torch.futures.Future()
    state._issued = issued
    gate = torch.futures.collect_all([first] if prev is None else [first, prev])

    def run(_: torch.futures.Future) -> None:
        try:
            first.value()  # a failed uplink fails this bucket
            fut2, finish, later = stage2()
        except Exception as e:  # noqa: BLE001 - raised, with its type, at the end of backward()
            issued.set_result(None)
            _fail(result, state, e, grad)
            return
        if later is None:
            issued.set_result(None)
        else:
            later.then(lambda _: issued.set_result(None))

        def done(f: torch.futures.Future) -> None:
            try:
                f.value()
                result.set_result(finish())
            except Exception as e:  # noqa: BLE001 - raised, with its type, at the end of backward()
                _fail(result, state, e, grad)

        fut2.then(done)

    gate.then(run)
    return result
