"""HSDP's replicate leg through the DDP hook: shard inside a node, replicate across nodes, and the
cross-node gradient reduction sent compressed.

FSDP2 (torch 2.13, ``_fsdp_collectives.foreach_reduce``) reduces a unit's gradients in two legs: the
reduce-scatter over the shard group (inside a node), then, for HSDP, an all-reduce of the shard it
produced over the replicate group (across nodes), then ``FSDPModule.set_all_reduce_hook``'s hook on
the result. The hook is the seam:

* **1-D shard mesh + a replica group** (``fully_shard(..., mesh=init_device_mesh(dev, (S,)))``, one
  such mesh per node, and a process group joining the ranks that hold the same shard on every node):
  FSDP runs no all-reduce, and the hook receives the reduce-scatter output; here it all-reduces it
  across the replica group itself (as torchft does).
* **2-D mesh** (``init_device_mesh(dev, (R, S), mesh_dim_names=("replicate", "shard"))``): FSDP runs
  its own all-reduce over the replicate dimension before the hook, and 2.13 has no custom all-reduce.
  :func:`install` gives each unit's parameter group a copy of its mesh information whose replicate
  group is this rank alone, so FSDP's all-reduce moves nothing (and FSDP's divide factors count the
  shard group only, exactly as for a 1-D mesh); the hook then does the cross-node reduction. The
  parameters stay DTensors on the 2-D mesh (``Replicate(), Shard(0)``): state dicts are unchanged.

The cross-node reduction is :func:`dqsgd.ddp.hook` run with the user's
:class:`~dqsgd.ddp.HookState` (built over the replica group) on a bucket holding the unit's reduced
shard: unit u is the hook's bucket u, its parameters the unit's padded shard pieces. Whatever the
hook does over a replica group — any registered method, budgets and policies, error feedback, the
sharded topology with its quantized (or fp32, or error-fed) downlink, warm-up, refusals and the rank
agreement — is what HSDP's replicate leg does, by construction.

The leg computes the mean over the R replicas, as FSDP's ``AVG`` all-reduce does; with
``set_gradient_divide_factor(f)`` FSDP sums across replicas and divides by f once, so the mean is
multiplied by R. The leg runs every backward: under gradient accumulation
(``set_requires_all_reduce(False)``) a 1-D mesh's hook still runs each micro-batch (FSDP's own
behaviour for an all-reduce hook), while on a 2-D mesh FSDP skips it until the step that reduces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from dqsgd.ddp.state import HookState

_SELF_GROUP: list[dist.ProcessGroup] = []  # this rank alone: the 2-D mesh's replicate group, emptied


class _Piece:
    """A parameter as the hook reads it: its element count (the unit's padded shard piece)."""

    def __init__(self, n: int):
        self.n = n

    def numel(self) -> int:
        return self.n


class ShardBucket:
    """The part of ``torch.distributed.GradBucket`` that :func:`dqsgd.ddp.hook` reads: the flat
    gradient (``buffer``), the bucket index, whether it is the backward's last, and the parameters'
    element counts."""

    def __init__(self, index: int, grad: torch.Tensor, pieces: Sequence[int], last: bool):
        self._index, self._grad, self._last = index, grad, last
        self._pieces = [_Piece(int(n)) for n in pieces]

    def buffer(self) -> torch.Tensor:
        return self._grad

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[_Piece]:
        return self._pieces


class Overlap:
    """The replicate legs of one model left in flight by the running backward: each leg's write of its
    result into its shard (a future), waited for by the leg that FSDP reduces last, which then relays
    refusals over the shard group once for them all."""

    def __init__(self) -> None:
        self.legs: list[tuple[ReplicateLeg, torch.futures.Future]] = []

    def holds(self, leg: ReplicateLeg) -> bool:
        return any(held is leg for held, _ in self.legs)

    def wait(self) -> list[int]:
        """Wait for every leg's write (a failed leg raises its error here); their units."""
        legs, self.legs = self.legs, []
        for _, written in legs:
            written.wait()
        return [leg.index for leg, _ in legs]


class ReplicateLeg:
    """FSDP's all-reduce hook for one unit: its reduced shard averaged across the replica group by
    :func:`dqsgd.ddp.hook` (bucket ``unit``), written back in place. ``last``: the unit FSDP reduces
    last in a backward (the hook counts a step there).

    **Overlapped** where FSDP's code after the hook leaves the shard as the hook wrote it (the shard
    becomes the gradient as it is: reduce dtype = parameter dtype, float32 or bfloat16, no divide
    factor or forced sum, no gradient to accumulate into, no CPU offload or post-accumulate-grad hook;
    a CPU tensor), inside a backward and for every unit but the ``last``: the call returns once the
    hook has issued the exchange, which runs while autograd goes on with the backward of the next
    units; the result is written into the shard when it arrives. The ``last`` leg (and any leg that
    cannot overlap) waits: for its own result, for the writes of the legs left in flight (in
    ``overlap``, which the model's legs share), then relays refusals once. The hook's end-of-backward
    callback also waits for every write, so the gradients are complete when ``backward()`` returns."""

    def __init__(self, state: HookState, unit: int, pieces: Sequence[int] | None, param_group: Any, last: bool,
                 shard: dist.ProcessGroup | None = None, overlap: Overlap | None = None):
        self.state, self.index, self.last, self.calls = state, unit, last, 0
        self.pieces = None if pieces is None else tuple(int(p) for p in pieces)
        self._group, self._shard, self.overlap = param_group, shard, overlap

    def __call__(self, reduce_output: torch.Tensor) -> None:
        from dqsgd.ddp import hook

        n = reduce_output.numel()
        pieces = self.pieces if self.pieces is not None and sum(self.pieces) == n else (n,)
        flat = reduce_output.reshape(-1)
        ov = self.overlap
        if ov is not None and ov.holds(self):  # a backward that never reached the last unit (it failed)
            self._relay(f"FSDP units {ov.wait()}, replicate legs left by an unfinished backward")
        fut = hook(self.state, ShardBucket(self.index, flat, pieces, self.last))
        self.calls += 1
        if ov is not None and not self.last and self.state._queued is not None and self._as_is(reduce_output):
            written = fut.then(lambda f: self._write(f.value(), flat))
            self.state._futures.append(written)  # waited for by the hook's end-of-backward callback too
            ov.legs.append((self, written))
            return
        out = fut.wait()
        units = [] if ov is None else ov.wait()
        self._relay(f"FSDP unit {self.index}, replicate leg {self.calls - 1}" +
                    (f" (and the legs of units {units} in flight)" if units else ""))
        self._write(out, flat)

    def _as_is(self, reduce_output: torch.Tensor) -> bool:
        """Whether FSDP turns the shard into the parameters' gradients as it is, so that it may be
        written after the call (see the class's text)."""
        g = self._group
        if (reduce_output.device.type != "cpu" or reduce_output.dtype not in (torch.float32, torch.bfloat16)
                or getattr(g, "gradient_divide_factor", None) is not None
                or getattr(g, "force_sum_reduction_for_comms", True)):
            return False
        params = getattr(g, "fsdp_params", None)
        return bool(params) and all(
            fp.sharded_param.grad is None and fp.sharded_param.dtype == reduce_output.dtype
            and not getattr(fp, "offload_to_cpu", True) and not getattr(fp.sharded_param, "_post_accumulate_grad_hooks",
                                                                         None) for fp in params)

    def _write(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        if getattr(self._group, "gradient_divide_factor", None) is not None:  # FSDP sums across replicas
            out = out * dist.get_world_size(self.state.process_group)
        if out.data_ptr() != flat.data_ptr():  # warm-up's plain all-reduce works in place
            flat.copy_(out.reshape(-1))

    def _relay(self, where: str) -> None:
        """A payload refused in one replica group stops the whole grid: the hook keeps the error of a
        refused payload for the end of backward() (its replica group's ranks raise it there); one
        all-gather of the exchange's status messages over the shard group (inside the node) then makes
        every rank of the node raise it now, naming the refusing rank (:func:`relay_refusal`)."""
        if self._shard is None or dist.get_world_size(self._shard) == 1:
            return
        relay_refusal(self._shard, self.state.timeout, self.state.pending_error,
                      f"rank {dist.get_rank(self._shard)}: {where}")


def relay_refusal(group: dist.ProcessGroup, timeout: float | None, error: Exception | None, where: str) -> int:
    """Every rank raises the error of a payload that some rank of ``group`` refused (the exchange's
    status message, :func:`dqsgd.topology.refusal.relay`), naming ``where`` and the refusing rank —
    or, where that rank's own exchange failed (a timeout, a peer gone), that error as a RuntimeError
    naming the rank; else returns the bytes this rank handed to the group."""
    from dqsgd.fsdp.net import exchange_group
    from dqsgd.topology.refusal import ROOM, relay

    g = exchange_group(group, timeout)
    g.wait(relay(g, error, lambda j: f"{where}: rank {j} refused a payload it received",
                 lambda j: f"{where}: rank {j}'s exchange failed"))
    return (g.size - 1) * (ROOM + 1)  # one status message to every peer


def _self_group() -> dist.ProcessGroup:
    if not _SELF_GROUP:
        _SELF_GROUP.append(dist.new_group([dist.get_rank()], use_local_synchronization=True))
    return _SELF_GROUP[0]


def replica_groups(param_group: Any, state: HookState, index: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard group, replica group) of one unit, after checking that ``state``'s process group is
    the unit's replica group: on a 2-D mesh the mesh's replicate group (then emptied for FSDP,
    see the module's text); on a 1-D mesh a group that meets the shard group in this rank only."""
    info = _mesh_info(param_group)
    pg = state.process_group
    if not hasattr(info, "shard_process_group"):
        raise ValueError(f"FSDP unit {index} is replicated only (no shard dimension): use dqsgd.ddp's hook for DDP")
    shard = info.shard_process_group
    if pg is None:
        raise ValueError("dqsgd.fsdp.compress(replicate=HookState(...)): the HookState needs process_group= the "
                         "replica group (2-D mesh: mesh.get_group('replicate'); 1-D mesh: the group of the ranks "
                         "holding this rank's shard on every node)")
    mine = dist.get_process_group_ranks(pg)
    if hasattr(info, "replicate_process_group"):  # HSDP on a 2-D mesh (FSDP's HSDPMeshInfo)
        theirs = getattr(info, "_dqsgd_replicate_ranks", None) or dist.get_process_group_ranks(
            info.replicate_process_group)
        if list(mine) != list(theirs):
            raise ValueError(f"FSDP unit {index}: the HookState's process group holds ranks {mine}, the mesh's "
                             f"replicate dimension {theirs}: pass process_group=mesh.get_group('replicate')")
        return shard, pg
    together = set(mine) & set(dist.get_process_group_ranks(shard))
    if together != {dist.get_rank()}:
        raise ValueError(f"FSDP unit {index}: the replica group {mine} shares ranks {sorted(together)} with the shard "
                         f"group {dist.get_process_group_ranks(shard)}: it must join, across nodes, the ranks that "
                         "hold this rank's shard (the same position in each node's shard group)")
    return shard, pg


def empty_native_all_reduce(param_group: Any) -> None:
    """A 2-D mesh: give the unit a copy of its mesh information whose replicate group is this rank
    alone, so that FSDP's own all-reduce moves nothing and its divide factors count the shard group
    (the replicate leg is the hook's). Nothing to do on a 1-D mesh."""
    import copy

    info = _mesh_info(param_group)
    if not hasattr(info, "replicate_process_group") or getattr(info, "_dqsgd_replicate_ranks", None) is not None:
        return
    mine = copy.copy(info)
    mine._dqsgd_replicate_ranks = dist.get_process_group_ranks(info.replicate_process_group)
    mine.replicate_process_group = _self_group()
    param_group.mesh_info = mine


def _mesh_info(param_group: Any) -> Any:
    """The unit's mesh information (FSDP2's FSDPMeshInfo / HSDPMeshInfo, read by its attributes)."""
    info = getattr(param_group, "mesh_info", None)
    if info is None:
        raise RuntimeError(f"dqsgd.fsdp's replicate leg reads FSDP2's parameter group mesh_info (torch 2.13); this "
                           f"torch is {torch.__version__}")
    return info
