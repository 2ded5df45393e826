"""Issue 40, causes 1 and 5 in one process: saved states are compared key by key with the configuration
they are loaded into and refused naming each differing key; malformed states are refused before
anything is loaded; every setting goes through the one range check (dqsgd.core.ranges)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import dqsgd.fsdp as dfsdp
from dqsgd.cli.commands import main
from dqsgd.data import load_dataset
from dqsgd.ddp import HookState
from dqsgd.method.config import method_config
from dqsgd.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from dqsgd.train.config import ConfigError, MethodEntry, TrainConfig, load_experiment
from dqsgd.train.local_sgd import LocalSGDOptimizer
from dqsgd.train.trainer import Trainer

DATA = load_dataset("synthetic")


def cfg(**kw) -> TrainConfig:
    base = dict(name="t", dataset="synthetic", model="mlp", workers=2, steps=4, batch_size=8, lr=0.1, eval_every=2,
                threads=1)
    return TrainConfig(**{**base, **kw})


# --- cause 1: one state and configuration agreement --------------------------------------------------
@pytest.mark.parametrize("saved, here, named", [
    (method_config("qsgd", bits=8), method_config("qsgd", bits=2), "method.bits: 8 saved, 2 here"),
    (method_config("dqsgd", target_bits=6.0), method_config("dqsgd", target_bits=2.0),
     "method.target_bits: 6.0 saved, 2.0 here"),
    (method_config("qsgd", coding="elias"), method_config("qsgd", coding="rans"),
     "method.coding: 'elias' saved, 'rans' here"),
])
def test_e1_fsdp_state_of_another_configuration_is_refused_naming_the_key(saved, here, named) -> None:
    state = dfsdp.FSDPState(saved, total_steps=6).state_dict()
    with pytest.raises(ValueError, match=named):
        dfsdp.FSDPState(here, total_steps=6).load_state_dict(state)


def test_e1_fsdp_state_of_another_horizon_is_refused() -> None:
    state = dfsdp.FSDPState("dqsgd", total_steps=6).state_dict()
    with pytest.raises(ValueError, match="total_steps: 6 saved, 1000 here"):
        dfsdp.FSDPState("dqsgd", total_steps=1000).load_state_dict(state)
    dfsdp.FSDPState("dqsgd", total_steps=6, min_numel=5).load_state_dict(state)  # a manner may change


def test_l2_checkpoint_mismatch_names_the_key_in_one_short_line(tmp_path: Path) -> None:
    bits8 = MethodEntry("q", method_config("qsgd", bits=8))
    tr = Trainer(cfg(), bits8, DATA, 0)
    tr.step()
    save_checkpoint(tr, tmp_path / "checkpoint.pt")
    other = Trainer(cfg(), MethodEntry("q", method_config("qsgd", bits=2)), DATA, 0)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(other, tmp_path / "checkpoint.pt")
    assert "method.bits: 8 saved, 2 here" in str(e.value) and len(str(e.value)) < 200, str(e.value)
    with pytest.raises(ValueError, match="method.bits: 8 saved, 2 here"):  # the state dict itself, too
        other.load_state_dict(tr.state_dict())


def test_l10_malformed_fsdp_states_are_refused_before_anything_is_loaded() -> None:
    st = dfsdp.FSDPState("qsgd-4bit", seed=3, total_steps=10)
    st.unit(0, 64, 2, 0, (32, 32))
    good = st.state_dict()
    fresh = dfsdp.FSDPState("qsgd-4bit", seed=3, total_steps=10)
    broken = [{k: v for k, v in good.items() if k != "units"},
              {**good, "counters": {k: v for k, v in good["counters"].items() if k != "calls"}},
              {**good, "counters": {**good["counters"], "calls": 7}, "units": {0: {**good["units"][0], "n": "x"}}},
              {**good, "counters": {**good["counters"], "calls": 7},
               "units": {0: {k: v for k, v in good["units"][0].items() if k != "generator"}}}]
    for state in broken:
        with pytest.raises(ValueError, match="malformed state"):
            fresh.load_state_dict(state)
        assert fresh.calls == 0 and fresh._loaded == {}  # nothing of it was loaded


@pytest.mark.parametrize("forge, named", [
    (lambda j, r: {j: r[:-1]}, "elements"), (lambda j, r: {j: torch.full_like(r, float("inf"))}, "NaN or Inf"),
    (lambda j, r: {j + 7: r}, "not a shard index"), (lambda j, r: {j: r.reshape(1, -1)}, "2-d"),
])
def test_l10_forged_downlink_residuals_of_a_trainer_state_are_refused_before_anything_is_loaded(forge, named) -> None:
    c = cfg(topology="sharded", downlink_bits=3, downlink_feedback=True)
    entry = MethodEntry("q", method_config("qsgd-4bit"))
    tr = Trainer(c, entry, DATA, 0)
    tr.step()
    tr.step()
    good = tr.state_dict()
    (j, r), *_ = good["down_residuals"].items()
    assert float(r.abs().max()) > 0
    fresh = Trainer(c, entry, DATA, 0)
    before = [p.detach().clone() for p in fresh.model.parameters()]
    with pytest.raises(ValueError, match=f"malformed state, 'down_residuals'.*{named}"):
        fresh.load_state_dict({**good, "down_residuals": forge(j, r)})
    assert all(torch.equal(a, p) for a, p in zip(before, fresh.model.parameters())) and fresh.next_step == 0
    fresh.load_state_dict(good)  # the good state still loads


@pytest.mark.parametrize("bad, named", [
    (torch.zeros(31), "has 31 elements, a shard of this bucket 32"), (torch.full((32,), float("nan")), "NaN or Inf"),
    (torch.zeros(2, 16), "2-d"), (torch.zeros(32, dtype=torch.int32), "floating"),
])
def test_l10_a_forged_downlink_residual_of_a_hook_bucket_is_refused_before_it_is_loaded(bad, named) -> None:
    from dqsgd.topology.bucket import worker_generator
    from dqsgd.topology.state import BucketState

    hook = HookState("qsgd-4bit", downlink_bits=3, downlink_feedback=True)
    proto = hook.protocol(0, 64, [64], 2, torch.float32)  # W = 2: two shards of 32

    def bucket(step: int) -> BucketState:
        return BucketState(numel=64, proto=proto, policy=proto.policy.init(), generator=worker_generator(3, 0, 0),
                           step=step)

    good = {**bucket(0).state_dict(), "down_residual": torch.full((32,), 0.25)}
    fresh = bucket(5)
    with pytest.raises(ValueError, match=f"bucket 0: malformed state, 'down_residual'.*{named}"):
        fresh.load({**good, "down_residual": bad}, 0)
    assert fresh.step == 5 and fresh.down_residual is None
    fresh.load(good, 0)
    assert fresh.step == 0 and torch.equal(fresh.down_residual, good["down_residual"])


def test_l10_malformed_hook_states_are_refused_with_a_clear_error() -> None:
    good = HookState("qsgd-4bit").state_dict()
    with pytest.raises(ValueError, match="malformed state, missing key"):
        HookState("qsgd-4bit").load_state_dict({k: v for k, v in good.items() if k != "counters"})


# --- cause 5: one range check for every setting ---------------------------------------------------
@pytest.mark.parametrize("seed", [-1, 2**32, 2**70])
def test_l5_seeds_out_of_range_are_refused_at_load(seed: int) -> None:
    with pytest.raises(ConfigError, match="seeds must be an integer in 0..4294967295"):
        load_experiment("table1-mnist", [f"train.seeds=[{seed}]"])
    with pytest.raises(ValueError, match="seed must be an integer in 0"):
        HookState("qsgd-4bit", seed=seed)
    with pytest.raises(ValueError, match="seed must be an integer in 0"):
        dfsdp.FSDPState("qsgd-4bit", seed=seed)


TINY = ["--set", "train.dataset=synthetic", "--set", "train.model=mlp", "--set", "train.steps=4",
        "--set", "train.eval_every=2", "--set", "train.workers=2", "--set", "train.batch_size=8"]


@pytest.mark.parametrize("extra", [[], ["--transport", "torch"]])
def test_l6_dry_run_refuses_a_downlink_target_the_run_refuses(tmp_path: Path, capsys, monkeypatch, extra) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--method", "qsgd", *TINY, "--set", "train.downlink_target_bits=3", *extra,
                 "--dry-run"]) == 2
    assert "downlink_target_bits" in capsys.readouterr().err
    assert main(["train", "--method", "qsgd", *TINY, "--set", "train.downlink_target_bits=17", "--dry-run"]) == 2
    assert list(tmp_path.iterdir()) == []


def test_l6_a_downlink_target_on_ps_is_refused_not_ignored() -> None:
    with pytest.raises(ValueError, match="downlink_target_bits"):
        Trainer(cfg(topology="ps", downlink_target_bits=3.0), MethodEntry("dqsgd", method_config("dqsgd")), DATA, 0)


@pytest.mark.parametrize("timeout", [1e30, math.inf, math.nan, 0, -1, 8 * 86400])
def test_l8_hook_and_fsdp_refuse_a_timeout_out_of_range(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout must be in"):
        HookState("qsgd-4bit", timeout=timeout)
    with pytest.raises(ValueError, match="timeout must be in"):
        dfsdp.FSDPState("qsgd-4bit", timeout=timeout)
    assert HookState("qsgd-4bit", timeout=7 * 86400).timeout == 7 * 86400


@pytest.mark.parametrize("outer, lr, momentum, named", [
    ("sgd", math.nan, 0.0, "outer_lr"), ("sgd", math.inf, 0.0, "outer_lr"), ("sgd", 1e30, 0.0, "outer_lr"),
    ("sgd", 0.0, 0.0, "outer_lr"), ("nesterov", 0.7, 1.0, "outer_momentum"), ("nesterov", 0.7, 0.0, "outer_momentum"),
])
def test_l9_local_sgd_wrapper_refuses_the_outer_values_the_config_refuses(outer, lr, momentum, named) -> None:
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=named):  # before any process group is needed
        LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, 4, "qsgd-4bit", outer=outer,
                          outer_lr=lr, outer_momentum=momentum)
    with pytest.raises(ConfigError, match=named):
        cfg(outer_optimizer=outer, outer_lr=lr, outer_momentum=momentum)


@pytest.mark.parametrize("key, value", [("sketch_rows", 10**9), ("sketch_cols", 1e9), ("sketch_p", 1e9),
                                        ("sketch_rows", 0)])
def test_m5_sketch_sizes_out_of_range_are_refused(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{key} must be"):
        method_config("sketched-sgd", **{key: value})
    with pytest.raises(ConfigError, match=f"{key} must be"):
        load_experiment("table1-mnist", [f"methods.sk.method=\"sketched-sgd\"", f"methods.sk.{key}={value}"])


@pytest.mark.parametrize("rate", [1.0, 0.0, 1e9])
def test_m7_hook_and_fsdp_refuse_sketched_sgd_whatever_the_rate(rate: float) -> None:
    with pytest.raises(ValueError, match="two rounds"):
        HookState("sketched-sgd", min_compression_rate=rate)
    with pytest.raises(ValueError, match="two rounds"):
        dfsdp.FSDPState("sketched-sgd", min_compression_rate=rate)
