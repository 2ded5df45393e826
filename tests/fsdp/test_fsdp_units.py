"""dqsgd.fsdp without processes: ops, dtypes, configurations, checkpoints and install errors."""

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dqsgd.fsdp as dfsdp
from dqsgd.fsdp import comm
from dqsgd.fsdp.protocol import _count, _padded_sample, _sample_len


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
    u.n, u.calls, u.residual = 4, 5, torch.ones(64)
    saved = st.state_dict()
    other = dfsdp.FSDPState("dqsgd", seed=3, total_steps=10)
    other.load_state_dict(saved)
    v = other.unit(0, 64, 2, 0, (32, 32))
    assert (v.n, v.calls, torch.equal(v.residual, u.residual)) == (4, 5, True)
    with pytest.raises(ValueError, match="checkpoint's numel"):
        again = dfsdp.FSDPState("dqsgd", seed=3, total_steps=10)
        again.load_state_dict(saved)
        again.unit(0, 66, 2, 0, (33, 33))
    with pytest.raises(ValueError, match="method.name: 'dqsgd' saved, 'qsgd-4bit' here"):
        dfsdp.FSDPState("qsgd-4bit", seed=3).load_state_dict(saved)
    with pytest.raises(ValueError, match="not a dqsgd FSDPState"):
        other.load_state_dict({"version": 0})


def test_policy_sample_is_the_whole_vectors_stride() -> None:
    """The pieces every rank gathers for a policy that reads G are G[::stride], whatever the shard edges."""
    g, world, stride = torch.arange(103, dtype=torch.float32), 4, 7
    n = -(-103 // world)
    g = torch.cat([g, torch.zeros(world * n - 103)])
    pieces = [_padded_sample(g[w * n:(w + 1) * n], w * n, stride, _sample_len(n, stride))[:_count(w * n, (w + 1) * n,
                                                                                                   stride)]
              for w in range(world)]
    assert torch.equal(torch.cat(pieces).float(), g[::stride])


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
