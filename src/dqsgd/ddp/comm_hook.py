"""The asynchronous DDP communication hook: a bucket in, one exchange call, a future out.

The bucket's exchange (:class:`dqsgd.topology.exchange.Exchange`, the one the trainer runs) encodes
it, issues its collectives and returns at once; decoding and averaging run when they complete, while
autograd goes on with the backward of the next buckets. What stays here is DDP's: buckets and
futures, warm-up and the plain all-reduce, and an error met in a completion callback raised with its
own type at the end of ``backward()``.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time
# (bucket: dist.GradBucket, return: torch.futures.Future[torch.Tensor]).
import warnings

import torch
import torch.distributed as dist

from dqsgd.ddp.state import HookState
from dqsgd.policies.linktime import UNCOMPRESSED
from dqsgd.topology.state import BucketState
from dqsgd.topology.exchange import Exchange
from dqsgd.topology.figures import observes
from dqsgd.topology.group import UP, done, release, then
from dqsgd.topology.registry import Legs, ring_bytes


def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Quantize, exchange, decode and average one gradient bucket (``register_comm_hook``)."""
    grad = bucket.buffer()
    _raise_at_end_of_backward(state)
    try:
        fut = _dispatch(state, bucket, grad)
        if state._queued is not None:
            state._futures.append(fut)
        return fut
    finally:
        if bucket.is_last():
            state.iter += 1
            state.steps += 1


def _dispatch(state: HookState, bucket: dist.GradBucket, grad: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    world = dist.get_world_size(state.process_group or dist.group.WORLD)
    if world == 1:  # nothing to send: the gradient as it is (no quantization noise, no traffic)
        return done(grad)
    state.agree(bucket)  # first call: every rank runs the same configuration (else all raise, naming the fields)
    if state.iter < state.start_iter or grad.numel() < world:
        return _allreduce(state, grad, world)
    group = state.group()
    b = state.bucket(bucket.index(), grad, [p.numel() for p in bucket.parameters()], group.rank, world)
    if b.step == state.total_steps and state.config.dynamic:  # the first step past the horizon N
        warnings.warn(f"dqsgd hook: step {b.step} is past total_steps = {state.total_steps}, the horizon of the "
                      f"{state.config.name} policy; it keeps its last choice from now on (pass total_steps = the "
                      "number of training steps to HookState)", RuntimeWarning, stacklevel=2)
    b.prepare(grad.device)  # deferred payload checks; the policy fed what waited
    if b.bits == UNCOMPRESSED:  # the link policy: on this link the codec costs more time than it saves
        return _uncompressed(state, b, grad, world)
    width, itemsize = b.width(), grad.element_size()
    if b.numel * itemsize < state.min_compression_rate * b.uplink_bytes(b.width()):  # not worth compressing
        return _allreduce(state, grad, world)

    def count(legs: Legs, whole: bool) -> None:  # a coded downlink's bytes come later, alone
        state.count(legs[:2], legs[2:], *((b.numel, itemsize, width) if whole else (0, 0, 0)), world)

    step = b.step
    out = Exchange(b, count=count).start({group.rank: (grad, group, b)})[group.rank]
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def finish(f: torch.futures.Future) -> None:
        try:
            o = f.value()
            if o.update.device.type == "cpu" and bool(o.bad):
                _say_nonfinite(state, step)
            result.set_result(o.update.to(grad.dtype).reshape(grad.shape))
        except Exception as e:  # noqa: BLE001 - raised, with its type, at the end of backward()
            if state._queued is None:
                result.set_exception(e)
                return
            if state._error is None:
                state._error = e
            result.set_result(torch.full_like(grad, float("nan")))  # DDP's bucket meanwhile

    out.add_done_callback(finish)
    return result


def _allreduce(state: HookState, grad: torch.Tensor, world: int,
               dtype: torch.dtype | None = None) -> torch.futures.Future[torch.Tensor]:
    """Plain mean all-reduce in the bucket's dtype, or ``dtype`` (warm-up, small buckets, the link
    policy's uncompressed choice), counted as a ring."""
    send = grad if dtype is None or dtype == grad.dtype else grad.to(dtype)
    nbytes = send.numel() * send.element_size()
    scatter = (world - 1) * nbytes // world  # a ring's reduce-scatter, then its all-gather
    gather = ring_bytes(nbytes, world) - scatter
    state.count((scatter, scatter), (gather, gather), send.numel(), send.element_size(), 8 * send.element_size(),
                world, refused=True)
    group = state.group()
    prev, mine = group.turns.turn(UP)  # after the previous bucket's uplink collectives, as every rank

    def issue(_: object) -> torch.futures.Future:
        work = dist.all_reduce(send.div_(world), group=group.pgs[UP], async_op=True)
        release(mine)
        return then(work.get_future(), lambda _: grad if send is grad else grad.copy_(send))

    return then(prev, issue)


def _uncompressed(state: HookState, b: BucketState, grad: torch.Tensor, world: int) -> torch.futures.Future[torch.Tensor]:
    """The link policy's uncompressed step: the plain all-reduce (in ``uncompressed_dtype`` if set), a
    step of the bucket whose mean G (the same bytes on every rank) the policy observes at the steps it
    takes statistics of (``link_every``) — its norm and levels' entropies; σ̂² keeps its last value, no
    collective carrying the workers' norms then."""
    step = b.step
    b.step += 1
    fut = _allreduce(state, grad, world, state.send_dtype(grad.dtype))
    if not observes(b.proto.policy, step):  # between the policy's re-evaluations: nothing to observe
        return fut

    def seen(f: torch.futures.Future) -> torch.Tensor:
        g = f.value()
        flat = g.detach().reshape(-1).to(torch.float32)
        b.observe(flat, step, 8 * g.element_size() * g.numel(), ~torch.isfinite(flat).all())
        return g

    return fut.then(seen)


def _say_nonfinite(state: HookState, step: int) -> None:
    """Warn once per HookState, naming the step, that a rank's bucket held NaN or Inf."""
    if state.nonfinite_step is not None:
        return
    state.nonfinite_step = step
    warnings.warn(f"dqsgd hook: step {step} (the bucket's compressed step): some rank's gradient bucket holds NaN or "
                  "Inf, so every rank gets NaN for it (a GradScaler skips such a step). If the loss stays non-finite "
                  "the run has diverged: lower the lr, or raise downlink_bits or set downlink_feedback=True. "
                  "Said once.", RuntimeWarning, stacklevel=2)


def _raise_at_end_of_backward(state: HookState) -> None:
    """Once per backward pass: queue a callback of the autograd engine, run after DDP has waited for
    every bucket, that raises the first error a bucket's callback met (a refused payload), with its
    own type, to backward()'s caller. A future that fails instead reaches the caller as a
    RuntimeError that has lost the type; a failed bucket's future holds NaN."""
    task = _backward_id()
    if state._queued is not None and state._queued == task:
        return
    # state._queued holds another backward's id: that backward raised before its end (its callbacks never
    # ran); its futures are waited for, and its error raised, at the end of this one

    def end() -> None:
        futures, state._futures = state._futures, []
        for f in futures:  # the engine may run this before DDP waits for the buckets
            try:
                f.wait()
            except Exception:  # noqa: BLE001 - a failed future raises in DDP's own wait
                pass
        state._queued = None
        err, state._error = state._error, None
        if err is not None:
            raise err

    try:
        torch.autograd.Variable._execution_engine.queue_callback(end)
    except RuntimeError:  # called outside a backward pass (a direct call): errors stay in the futures
        state._queued = None
        return
    state._queued = task


def _backward_id() -> int:
    """The running backward pass's id (autograd's graph task; -2 where this torch does not say: then one
    callback is queued until one runs, as before)."""
    get = getattr(torch._C, "_current_graph_task_id", None)
    return -2 if get is None else int(get())
