"""The ``ReduceScatter`` that FSDP2 calls for one unit's gradients, and :func:`compress`, which
installs one on every FSDP unit of a model.

FSDP (torch 2.13, ``_fsdp_collectives.foreach_reduce``) copies a unit's gradients into one flat
buffer of W·n elements in the reduce dtype — chunk j holds every parameter's padded shard j —,
calls ``comm(output_tensor=out, input_tensor=flat, group=shard_group, op=op)`` with
``async_op=False`` and ignores the return value, then reads ``out`` (n elements) as this rank's
reduced shard. ``op`` is ``AVG`` (fp32/bf16 reduce dtype), ``SUM`` (fp16, or a forced sum; FSDP
divides before and after) or ``PREMUL_SUM(1/f)`` (``set_gradient_divide_factor(f)``).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from dqsgd.fsdp.net import Done, exchange_group, transport, wait
from dqsgd.fsdp.state import FSDPState

if TYPE_CHECKING:
    from dqsgd.ddp.state import HookState
    from dqsgd.topology.state import BucketState

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TESTED_TORCH = "2.13"


def _base() -> type:
    try:  # the interface class lives in a private torch module; its absence is reported by compress()
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:
        return object
    return ReduceScatter


def _kind(op: Any) -> tuple[Any, Any]:
    """(the op's RedOpType, its PREMUL_SUM factor or None), from a RedOpType or a ReduceOp."""
    if isinstance(op, dist.ReduceOp.RedOpType):
        return op, None
    state = op.__getstate__() if isinstance(op, dist.ReduceOp) else None
    return state if isinstance(state, tuple) else (op, None)


def reduce_scale(op: Any, world: int) -> float:
    """The factor applied to Σ_w g_w: AVG → 1/W, SUM → 1, PREMUL_SUM(f) → f."""
    kind, factor = _kind(op)
    if kind == dist.ReduceOp.AVG:
        return 1.0 / world
    if kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.PREMUL_SUM and factor is not None:
        f = float(factor.item() if isinstance(factor, torch.Tensor) else factor)
        if math.isfinite(f):
            return f
    raise ValueError(f"dqsgd's FSDP reduce-scatter supports op AVG, SUM and PREMUL_SUM(factor); got {op!r}")


class DQSGDReduceScatter(_base()):  # type: ignore[misc]
    """FSDP2's reduce-scatter for one unit: the flat gradient buffer handed to one
    :class:`~dqsgd.topology.exchange.Exchange` call of the ``sharded`` topology (``scatter``: the
    uplink's all-to-all of coded shard payloads, then one all-gather of small status messages instead
    of a downlink), and this rank's averaged shard written back to the output. Synchronous: the
    output is complete when the call returns."""

    def __init__(self, state: FSDPState, unit: int, pieces: Sequence[int] | None = None):
        self.state, self.index = state, unit
        self.pieces = None if pieces is None else tuple(int(p) for p in pieces)
        self._checked = False

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        t0 = time.perf_counter()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = reduce_scale(op, world)
        _check_tensors(output_tensor, input_tensor, world)
        st = self.state
        b = st.unit(self.index, input_tensor.numel(), world, rank, self._layout(input_tensor.numel(), world))
        if not self._checked:
            self._agree(group, b)
        if self._exact(b, input_tensor):
            self._exact_reduce(output_tensor, input_tensor, group, op, scale, world)
        else:
            self._compressed(b, output_tensor, input_tensor, group, scale)
        st.unit_calls[self.index] = st.unit_calls.get(self.index, 0) + 1
        st.seconds += time.perf_counter() - t0
        return Done() if async_op else None

    # --- pieces ---------------------------------------------------------------------------------
    def _layout(self, numel: int, world: int) -> tuple[int, ...]:
        """The flat buffer's pieces: every parameter's padded shard, once per chunk (one piece per
        chunk when the parameter sizes are unknown or do not add up)."""
        if self.pieces is not None and sum(self.pieces) * world == numel:
            return self.pieces * world
        return (numel // world,) * world

    def _agree(self, group: dist.ProcessGroup, b: BucketState) -> None:
        """Every rank's configuration and unit layout, compared once per unit with the project's one
        rank agreement (:func:`dqsgd.topology.agreement.agree`: a fixed-size all-gather)."""
        from dqsgd.topology.agreement import SLOTS, RankDisagreement, agree

        world = b.proto.workers
        fields = {**self.state.fields(), "fsdp.unit": self.index, "fsdp.unit_numel": b.numel,
                  "fsdp.unit_pieces": list(b.sizes[: len(b.sizes) // world]),
                  "progress.calls": self.state.unit_calls.get(self.index, 0),
                  "progress.steps": b.step}  # ranks resumed from different states differ
        self.state.side_bytes += (world - 1) * (2 + SLOTS) * 8  # the fingerprint's int64 to every peer
        try:
            agree(fields, transport(group, self.state.timeout).all_gather_ints, dist.get_rank(group))
        except RankDisagreement as e:
            raise RankDisagreement(f"FSDP unit {self.index}: {e}; every rank needs the same FSDPState and the same "
                                   "model") from e
        self._checked = True

    # --- the two paths --------------------------------------------------------------------------
    def _exact(self, b: BucketState, x: torch.Tensor) -> bool:
        """Warm-up, small units and units that would not compress enough go as FSDP's own reduce-scatter."""
        st = self.state
        if st.unit_calls.get(self.index, 0) < st.start_iter or b.numel < max(st.min_numel, b.proto.workers):
            return True
        return b.numel * x.element_size() < st.min_compression_rate * b.uplink_bytes(b.width())

    def _exact_reduce(self, out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup, op: Any, scale: float,
                      world: int) -> None:
        kind = _kind(op)[0]
        native = kind in (dist.ReduceOp.AVG, dist.ReduceOp.SUM) or dist.get_backend(group) == "nccl"
        work = dist.reduce_scatter_single(output=out, input=x, op=op if native else dist.ReduceOp.SUM, group=group,
                                          async_op=True)
        wait(work, self.state.timeout, "exact reduce-scatter")
        if not native:
            out.mul_(scale)
        nbytes = x.numel() * x.element_size()
        self.state.count(0, 0, 0, x.numel(), world, 8 * x.element_size(), exact=(world - 1) * nbytes // world,
                         itemsize=x.element_size(), refused=True)

    def _compressed(self, b: BucketState, out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup,
                    scale: float) -> None:
        """One exchange call; a payload any rank refused raises on every rank, its type and text told
        in the exchange's status messages; a rank's NaN/Inf (an AMP overflow) gives NaN everywhere, as
        FSDP's own sum does, and keeps the residuals (the step is skipped)."""
        from dqsgd.codecs import PayloadError
        from dqsgd.method.pipeline import ProtocolError
        from dqsgd.topology.exchange import Exchange
        from dqsgd.topology.registry import ring_bytes

        g, world = exchange_group(group, self.state.timeout), b.proto.workers
        b.prepare(g.device)  # a payload refused on the device path raises here
        width, legs = b.width(), []
        fut = Exchange(b, count=lambda got, _: legs.append(got), scatter=True).start(
            {g.rank: (x.detach().reshape(-1).to(device=g.device, dtype=torch.float32), g, b)})[g.rank]
        try:
            o = g.wait(fut)
        except (PayloadError, ProtocolError) as e:
            raise type(e)(f"FSDP unit {self.index}: {e}") from e
        b.catch_up(b.step)  # the width of the unit's next step
        out.copy_((o.update if world * scale == 1.0 else o.update * (world * scale)).reshape(out.shape))
        side = legs[0].down_sent + ring_bytes(o.side, world)  # statuses, TernGrad's scalers (up_sent: the sizes too)
        self.state.count(legs[0].up_sent, legs[0].up_received, side, b.numel, world, 0 if bool(o.bad) else width,
                         itemsize=x.element_size())


def _check_tensors(out: torch.Tensor, x: torch.Tensor, world: int) -> None:
    if x.dtype not in DTYPES or out.dtype != x.dtype:
        raise TypeError(f"dqsgd's FSDP reduce-scatter reduces float32, bfloat16 or float16 gradients "
                        f"(MixedPrecisionPolicy.reduce_dtype); got input {x.dtype}, output {out.dtype}")
    if x.numel() != world * out.numel():
        raise ValueError(f"reduce-scatter input of {x.numel()} elements for an output of {out.numel()} "
                         f"over {world} ranks (need input = W · output)")


def compress(model: torch.nn.Module, state: FSDPState | None, *, gradients: bool = True,
             replicate: HookState | None = None) -> list[Any]:
    """Install a :class:`DQSGDReduceScatter` (``gradients=False`` or ``state=None``: none, FSDP's own
    reduce-scatter stays) and, when ``state.param_bits`` is set, a
    :class:`~dqsgd.fsdp.gather.DQSGDAllGather` on every FSDP unit of ``model`` (every module that
    ``fully_shard`` was applied to and that owns parameters), numbered in ``model.modules()`` order —
    the same on every rank. ``replicate``: HSDP, a :class:`dqsgd.ddp.HookState` over the replica
    group (:mod:`dqsgd.fsdp.hsdp`): each unit's reduced shard is averaged across the replicas by the
    DDP hook (a 2-D mesh's own all-reduce is emptied). Returns the installed comms and replicate
    legs. Call after ``fully_shard`` and before the first forward."""
    from dqsgd.fsdp.gather import DQSGDAllGather
    from dqsgd.fsdp.hsdp import Overlap, ReplicateLeg, empty_native_all_reduce, replica_groups

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        FSDPModule = None
    if state is None and replicate is None:
        raise ValueError("compress(model, None) needs replicate=HookState(...) (HSDP's replicate leg): else nothing "
                         "would change")
    gradients = gradients and state is not None
    if not gradients and replicate is None and (state is None or state.param_bits is None):
        raise ValueError("compress(gradients=False) with FSDPState(param_bits=None) would change nothing: set "
                         "param_bits (8, 4 or 32) to quantize the parameter all-gather")
    if (FSDPModule is None or not hasattr(FSDPModule, "set_custom_reduce_scatter") or _base() is object
            or not hasattr(FSDPModule, "set_custom_all_gather") or not hasattr(FSDPModule, "set_all_reduce_hook")):
        raise RuntimeError(f"dqsgd.fsdp needs FSDP2's FSDPModule.set_custom_reduce_scatter (torch {TESTED_TORCH} "
                           f"is the version dqsgd is tested with); this torch is {torch.__version__}")
    _check_options(state, replicate)
    comms, shapes, index, group, replicas = [], {}, 0, None, None
    overlap = Overlap()  # the replicate legs left in flight by a backward, settled at its end
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = list(getattr(module._get_fsdp_state(), "_fsdp_param_groups", []))
        if not groups:
            continue  # a unit without parameters of its own issues no reduce-scatter
        pieces = _pieces(groups[0])
        if replicate is None:
            replicas = _check_mesh(groups[0], index)
            if state is not None and replicas is not None:
                state.replica = dist.get_rank(replicas)  # HSDP, FSDP's own all-reduce: each node its own roundings
        else:
            if len(groups) > 1:
                raise ValueError(f"FSDP unit {index} has {len(groups)} parameter groups (per-parameter meshes): the "
                                 "replicate leg needs one")
            group, replicas = replica_groups(groups[0], replicate, index)
            empty_native_all_reduce(groups[0])
            leg = ReplicateLeg(replicate, index, pieces, groups[0], last=index == 0, shard=group, overlap=overlap)
            module.set_all_reduce_hook(leg)
            comms.append(leg)
            if state is not None:
                state.replica = dist.get_rank(replicas)  # the nodes' reduce-scatters draw their own roundings
        if gradients:
            assert state is not None
            comm = DQSGDReduceScatter(state, index, pieces)
            module.set_custom_reduce_scatter(comm)  # raises for several parameter groups (per-parameter meshes)
            comms.append(comm)
        if state is not None and state.param_bits is not None:
            gather = DQSGDAllGather(state, index)
            module.set_custom_all_gather(gather)
            comms.append(gather)
        shapes[f"fsdp.unit{index}.shapes"] = [list(getattr(fp, "_orig_size", ())) for fp in groups[0].fsdp_params]
        group = group or getattr(groups[0], "_reduce_scatter_process_group", None)
        index += 1
    if not index:
        raise ValueError("compress: no FSDP unit with parameters in this model: apply fully_shard first")
    fields = {**(state.fields() if state is not None else {"fsdp.state": None}), "fsdp.units": index,
              "fsdp.gradients": gradients, **shapes}
    if replicate is not None:
        fields.update({f"replicate.{k}": v for k, v in replicate.fields().items()})
    if replicas is not None:  # HSDP: inside the node, then across the nodes
        fields.update({"replicate.world": dist.get_world_size(replicas), "shard.world": dist.get_world_size(group)})
    _agree_model(state or replicate, [group] if replicas is None else [group, replicas], fields)
    return comms


def _check_options(state: FSDPState | None, replicate: Any) -> None:
    from dqsgd.ddp import HookState

    if state is not None and not isinstance(state, FSDPState):
        raise TypeError(f"state must be a dqsgd.fsdp.FSDPState or None, got {type(state).__name__}")
    if replicate is not None and not isinstance(replicate, HookState):
        raise TypeError(f"replicate must be a dqsgd.ddp.HookState over the replica group, got {type(replicate).__name__}")


def _agree_model(state: Any, groups: list[dist.ProcessGroup | None], fields: dict[str, Any]) -> None:
    """The ranks' FSDPState and model (units and their parameters' full shapes), compared once, here, before
    FSDP's first parameter all-gather (which would fail on unequal shapes without naming them). HSDP: inside
    the shard group, then across the replica group, where a node whose ranks disagreed refuses, so that
    every rank of the grid raises."""
    from dqsgd.topology.agreement import RankDisagreement, agree

    error: RankDisagreement | None = None
    for group in groups:
        group = group or dist.group.WORLD
        try:
            agree(fields, transport(group, state.timeout).all_gather_ints, dist.get_rank(group),
                  refused=error is not None)
        except RankDisagreement as e:
            error = e
    if error is not None:
        raise RankDisagreement(f"dqsgd.fsdp.compress: {error}; every rank needs the same FSDPState, HookState and "
                               "model") from error


def _check_mesh(group: Any, index: int) -> dist.ProcessGroup | None:
    """The unit's replicate group under HSDP's 2-D mesh (FSDP's own all-reduce across nodes), else None."""
    params = [fp.sharded_param for fp in getattr(group, "fsdp_params", [])]
    mesh = getattr(params[0], "device_mesh", None) if params else None
    if mesh is not None and mesh.ndim > 2:
        raise ValueError(f"FSDP unit {index} is sharded on a {mesh.ndim}-D mesh: dqsgd.fsdp compresses FSDP (1-D) "
                         "and HSDP (2-D: replicate × shard) meshes")
    replicas = getattr(getattr(group, "mesh_info", None), "replicate_process_group", None)
    return None if mesh is None or mesh.ndim == 1 else replicas


def _pieces(group: Any) -> list[int] | None:
    try:
        return [int(fp.padded_sharded_param_size.numel()) for fp in group.fsdp_params]
    except AttributeError:
        return None
