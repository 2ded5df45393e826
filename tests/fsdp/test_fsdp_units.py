"""dqsgd.fsdp without processes: ops, dtypes, configurations, checkpoints and install errors."""

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dqsgd.fsdp as dfsdp
from dqsgd.codecs import PayloadError
from dqsgd.fsdp import comm
from dqsgd.fsdp.unit import unit_protocol
from dqsgd.method.config import method_config
from dqsgd.topology.exchange import Exchange
from dqsgd.topology.group import local_groups
from dqsgd.topology.bucket import worker_generator
from dqsgd.topology.state import BucketState, Memory


def test_reduce_scale_of_every_fsdp_op() -> None:
    assert dfsdp.reduce_scale(dist.ReduceOp.AVG, 4) == 0.25
    assert dfsdp.reduce_scale(dist.ReduceOp.SUM, 4) == 1.0
    assert dfsdp.reduce_scale(dist.ReduceOp.PREMUL_SUM(0.125), 4) == 0.125
    assert dfsdp.reduce_scale(dist.ReduceOp(dist.ReduceOp.SUM), 4) == 1.0
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
        with pytest.raises(ValueError, match="AVG, SUM and PREMUL_SUM"):
            dfsdp.reduce_scale(op, 4)


def test_tensor_checks_name_the_supported_dtypes() -> None:
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        comm._check_tensors(torch.zeros(2, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="need input = W · output"):
        comm._check_tensors(torch.zeros(2), torch.zeros(5), 2)


@pytest.mark.parametrize("method,match", [("signsgd", "majority vote is not a sum"), ("adaqs", "no FSDP rank holds")])
def test_methods_a_reduce_scatter_cannot_be_are_refused(method: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dfsdp.FSDPState(method)


@pytest.mark.parametrize("kw", [{"seed": -1}, {"total_steps": 0}, {"start_iter": 1.5}, {"timeout": 0},
                                {"min_compression_rate": -1.0}, {"min_numel": True}])
def test_bad_settings_are_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        dfsdp.FSDPState("qsgd-4bit", **kw)


def test_state_dict_round_trip_and_refusals() -> None:
    st = dfsdp.FSDPState("dqsgd", seed=3, total_steps=10)
    u = st.unit(0, 64, 2, 0, (32, 32))
    u.step, st.unit_calls[0], u.residuals = 4, 5, {0: torch.ones(32), 1: torch.full((32,), 2.0)}
    saved = st.state_dict()
    other = dfsdp.FSDPState("dqsgd", seed=3, total_steps=10)
    other.load_state_dict(saved)
    v = other.unit(0, 64, 2, 0, (32, 32))
    assert (v.step, other.unit_calls[0], sorted(v.residuals)) == (4, 5, [0, 1])
    assert all(torch.equal(v.residuals[j], u.residuals[j]) for j in (0, 1))
    with pytest.raises(ValueError, match="residual holds 63 elements"):
        again = dfsdp.FSDPState("dqsgd", seed=3, total_steps=10)
        again.load_state_dict({**saved, "units": {0: {**saved["units"][0], "residual": torch.ones(63)}}})
        again.unit(0, 64, 2, 0, (32, 32))
    with pytest.raises(ValueError, match="checkpoint's numel"):
        again = dfsdp.FSDPState("dqsgd", seed=3, total_steps=10)
        again.load_state_dict(saved)
        again.unit(0, 66, 2, 0, (33, 33))
    with pytest.raises(ValueError, match="method.name: 'dqsgd' saved, 'qsgd-4bit' here"):
        dfsdp.FSDPState("qsgd-4bit", seed=3).load_state_dict(saved)
    with pytest.raises(ValueError, match="not a dqsgd FSDPState"):
        other.load_state_dict({"version": 0})


def _units(method: str, world: int, n: int) -> tuple[BucketState, BucketState, list]:
    """A unit of W·n elements (two parameters per chunk) twice: for the scatter exchange and the full one."""
    pieces = [n - n // 3, n // 3] * world

    def unit() -> BucketState:
        P = unit_protocol(method_config(method), world * n, 6, pieces, world, 7)
        return BucketState(numel=world * n, proto=P, policy=P.policy.init(), sizes=tuple(pieces))

    return unit(), unit(), [Memory(generator=worker_generator(7, w % world)) for w in range(2 * world)]


@pytest.mark.parametrize("method", ["qsgd-4bit", "dqsgd", "dqsgd-coded", "ef-signsgd", "terngrad"])
def test_scatter_exchange_is_the_sharded_exchange_shard_by_shard(method: str) -> None:
    """FSDP's exchange (``scatter``: rank j keeps shard j, the policy fed G's statistics gathered from
    the shards) in one process, against the sharded exchange with its fp32 downlink (the simulation's):
    over 6 steps every rank's shard is bitwise that shard of the update, and the policies choose the
    same widths (‖G‖_∞ exact; dqsgd-coded's sample of G gathered from the shards)."""
    world, n = 4, 1000
    mine, full, mems = _units(method, world, n)
    for step in range(6):
        grads = [torch.randn(world * n, generator=torch.Generator().manual_seed(100 * step + w)) for w in range(world)]
        got = [_run(mine, grads, mems[:world], scatter=True), _run(full, grads, mems[world:], scatter=False)]
        assert mine.bits == full.bits, (method, step)
        for j in range(world):
            assert torch.equal(got[0][j], got[1][0][j * n:(j + 1) * n]), (method, step, j)
        if mine.proto.policy.needs_grad:
            assert torch.equal(mine.pending[-1][3], full.pending[-1][3])  # the same sample of G
        mine.catch_up(step)
        full.catch_up(step)


def _run(b: BucketState, grads: list[torch.Tensor], mems: list[Memory], scatter: bool) -> list[torch.Tensor]:
    groups = local_groups(len(grads))
    futures = Exchange(b, scatter=scatter).start({w: (g, groups[w], mems[w]) for w, g in enumerate(grads)})
    return [groups[w].wait(f).update for w, f in futures.items()]


def test_a_payload_one_rank_refuses_raises_on_every_rank_with_its_text() -> None:
    """The last rank flips a byte of its payload for rank 0: rank 0 alone refuses it, and every rank's
    exchange fails with rank 0's PayloadError, its text carried in the status messages."""
    b, _, mems = _units("qsgd-4bit", 3, 400)

    def tamper(a2a):
        def damaged(send, send_sizes, recv_sizes, leg):
            send = send.clone()
            send[send_sizes[0] // 2] ^= 0xFF
            return a2a(send, send_sizes, recv_sizes, leg)
        return damaged

    grads = [torch.randn(1200, generator=torch.Generator().manual_seed(w)) for w in range(3)]
    groups = local_groups(3)
    groups[-1].all_to_all = tamper(groups[-1].all_to_all)  # type: ignore[method-assign]
    futures = Exchange(b, scatter=True).start({w: (g, groups[w], mems[w]) for w, g in enumerate(grads)})
    for w, f in futures.items():
        with pytest.raises(PayloadError, match=rf"^rank {w}: step 0: rank 0 refused a payload it received: .*crc"):
            groups[w].wait(f)


def test_a_nonfinite_gradient_gives_nan_on_every_rank_and_keeps_the_residuals() -> None:
    b, _, mems = _units("ef-signsgd", 2, 300)
    grads = [torch.randn(600, generator=torch.Generator().manual_seed(w)) for w in range(2)]
    _run(b, grads, mems[:2], scatter=True)
    before = [dict(m.residuals) for m in mems[:2]]
    grads[1][5] = float("inf")
    out = _run(b, grads, mems[:2], scatter=True)
    assert all(torch.isnan(o).all() for o in out)
    assert all(torch.equal(m.residuals[j], r[j]) for m, r in zip(mems[:2], before) for j in r)
    b.catch_up(1)
    assert b.pending == [] and b.step == 2


def test_compress_refuses_a_model_without_fsdp_units() -> None:
    with pytest.raises(ValueError, match="apply fully_shard first"):
        dfsdp.compress(nn.Linear(2, 2), dfsdp.FSDPState("qsgd-4bit"))


def test_compress_names_the_torch_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.fsdp as tfsdp

    monkeypatch.setattr(tfsdp, "FSDPModule", types.new_class("FSDPModule"))
    with pytest.raises(RuntimeError, match=r"set_custom_reduce_scatter \(torch 2.13"):
        dfsdp.compress(nn.Linear(2, 2), dfsdp.FSDPState("qsgd-4bit"))


def _unit_on(ndim: int, replicas: object = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(fsdp_params=[types.SimpleNamespace(
        sharded_param=types.SimpleNamespace(device_mesh=types.SimpleNamespace(ndim=ndim)))],
        mesh_info=types.SimpleNamespace(replicate_process_group=replicas))


def test_meshes_above_2d_are_refused_and_hsdp_names_its_replicate_group() -> None:
    with pytest.raises(ValueError, match="3-D mesh"):
        comm._check_mesh(_unit_on(3), 0)
    assert comm._check_mesh(_unit_on(2, "replicas"), 0) == "replicas"  # HSDP: FSDP's all-reduce across nodes
    assert comm._check_mesh(_unit_on(1, "replicas"), 0) is None         # FSDP: no replicate leg of FSDP's own


def test_stats_are_the_hooks_object_and_the_old_dict_warns() -> None:
    """compression_stats() is the DDP hook's and Local SGD's CompressionStats; stats() still answers, warning."""
    from dqsgd.core.comm_stats import CompressionStats
    from dqsgd.ddp import HookState

    st = dfsdp.FSDPState("qsgd-4bit", seed=0, total_steps=10)
    st.count(sent=100, received=90, side=8, numel=64, world=2, width=4)
    s = st.compression_stats()
    assert type(s) is type(HookState("qsgd-4bit").compression_stats()) is CompressionStats
    assert (s.uplink_sent, s.uplink_received, s.downlink_sent, s.downlink_received) == (108, 98, 0, 0)
    assert (s.bytes_sent, s.mean_bits, s.refusals) == (108, 4.0, 0)
    with pytest.warns(DeprecationWarning, match="compression_stats"):
        old = st.stats()
    assert old["total_sent"] == s.bytes_sent and old["mean_bits"] == s.mean_bits
    assert "method='qsgd-4bit'" in repr(st)


@pytest.mark.parametrize("bad", [[1], {"0": 1}, {0: -1}, {0: 1.5}, {-1: 2}])
def test_a_forged_all_gather_count_is_refused_before_anything_is_loaded(bad: object) -> None:
    st = dfsdp.FSDPState("qsgd-4bit", seed=0, total_steps=10, param_bits=8)
    saved = st.state_dict()
    st.gather_calls[0] = 3
    with pytest.raises(ValueError, match="gather_calls"):
        st.load_state_dict({**saved, "gather_calls": bad})
    assert st.gather_calls == {0: 3}  # nothing of the forged state was loaded


def test_relay_raises_the_refusing_ranks_error_on_every_rank() -> None:
    """The status messages of the all-gather and HSDP's leg (:func:`dqsgd.topology.refusal.relay`):
    nothing refused completes on every rank; rank 1's refusal fails every rank with its type and text."""
    from dqsgd.method.pipeline import ProtocolError
    from dqsgd.topology.refusal import relay

    groups = local_groups(3)
    futures = [relay(g, None, lambda j: f"rank {j}") for g in groups]
    assert all(g.wait(f) is None for g, f in zip(groups, futures))
    groups = local_groups(3)
    futures = [relay(g, ProtocolError("header 7 of 9") if g.rank == 1 else None, lambda j: f"unit 0: rank {j} refused")
               for g in groups]
    for g, f in zip(groups, futures):
        with pytest.raises(ProtocolError, match=r"^unit 0: rank 1 refused: header 7 of 9$"):
            g.wait(f)
