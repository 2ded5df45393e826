"""The downlink specification: resolved once from a run's configuration, frozen, carried as it is."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from synthetic_runs import entry, train_config

from dqsgd.data import load_dataset
from dqsgd.ddp import HookState
from dqsgd.method.config import method_config
from dqsgd.topology.downspec import BEFORE, OPTIONS, DownlinkSpec, downlink_of, resolve_downlink
from dqsgd.topology.names import AUTO, FP32
from dqsgd.train.config import TrainConfig
from dqsgd.train.config import resolve_downlink as train_downlink
from dqsgd.train.trainer import Trainer


def test_resolve_downlink_gives_each_default_once() -> None:
    plain = resolve_downlink(policy="fixed", uplink_coding="fixed", vote=False, topology="sharded")
    assert plain == DownlinkSpec(8, "fixed", False, 0.0)
    coded = resolve_downlink(None, None, policy="dqsgd-coded", uplink_coding="auto", vote=False, topology="sharded")
    assert coded == DownlinkSpec(AUTO, "auto", False, 0.0) and coded.auto
    assert resolve_downlink(None, policy="dqsgd-coded", uplink_coding="auto", vote=False,
                            topology="ps") == DownlinkSpec(8, "fixed")  # no quantized downlink: fixed
    with pytest.raises(ValueError, match="train.downlink_coding: downlink_coding = 'rans'"):
        resolve_downlink(FP32, "rans", policy="fixed", uplink_coding="fixed", vote=False, topology="sharded",
                         where="train.")
    with pytest.raises(ValueError, match="downlink_bits=2 without error feedback"):
        resolve_downlink(2, policy="fixed", uplink_coding="fixed", vote=False, topology="sharded")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.bits = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="downlink_target_bits"):
        DownlinkSpec(8, target_bits=2.0)  # a target needs "auto"


def test_the_trainer_carries_its_one_spec_into_the_bucket_protocol() -> None:
    data = load_dataset("synthetic")
    tr = Trainer(train_config(topology="sharded", downlink_bits="auto", downlink_target_bits=3.0, downlink_feedback=True),
                 entry("dqsgd"), data, 0)
    P = tr.step_runner.protocol
    assert tr.downlink == DownlinkSpec(AUTO, "fixed", True, 3.0)
    assert tr.step_runner.downlink is tr.downlink
    assert (P.auto, P.down_coding, P.feedback, P.down_target) == (True, "fixed", True, 3.0)
    assert {k: tr.run_meta()[k] for k in tr.downlink.fields()} == tr.downlink.fields()  # the run's record


@pytest.mark.parametrize("opts", [{}, {"downlink_bits": 4, "downlink_coding": "auto"},
                                  {"downlink_bits": "auto", "downlink_target_bits": 2.0, "downlink_feedback": True},
                                  {"downlink_bits": 2, "allow_unsafe_downlink": True}])
def test_every_surface_resolves_its_options_with_one_function_and_holds_the_spec(opts: dict) -> None:
    """downlink_of reads a mapping of keyword options or a config's attributes: the hook (its state, its
    fingerprint, a pickled copy) and the [train] keys hold the very spec it gives."""
    cfg = method_config("dqsgd")
    spec = downlink_of(opts, cfg, "sharded")
    state = HookState("dqsgd", **opts)
    assert state.downlink == spec and pickle.loads(pickle.dumps(state)).downlink == spec
    assert {k: state.fields()[k] for k in spec.fields()} == spec.fields()
    assert train_downlink(TrainConfig(topology="sharded", **opts), cfg, "sharded") == spec


def test_the_spec_names_every_option_once() -> None:
    assert set(DownlinkSpec().fields()) | {"allow_unsafe_downlink"} == set(OPTIONS)
    assert set(BEFORE) < set(DownlinkSpec().fields())
    assert downlink_of({}, method_config("qsgd-4bit"), "ps") == DownlinkSpec(8, "fixed")
