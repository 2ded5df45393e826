"""The downlink specification: resolved once from a run's configuration, frozen, carried as it is."""

from __future__ import annotations

import dataclasses

import pytest
from synthetic_runs import entry, train_config

from dqsgd.data import load_dataset
from dqsgd.topology.downspec import DownlinkSpec, resolve_downlink
from dqsgd.topology.names import AUTO, FP32
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
