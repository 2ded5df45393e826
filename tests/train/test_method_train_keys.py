"""A ``[methods.LABEL]`` table's own values of the ``[train]`` downlink keys: an error-fed narrow downlink
row beside an fp32 ``sgd`` row in one config, each trainer running its own downlink."""

import pytest
from synthetic_runs import train_config

from dqsgd.data import load_dataset
from dqsgd.train.config import build_experiment
from dqsgd.train.trainer import Trainer

DATA = load_dataset("synthetic")


def test_downlink_feedback_is_a_method_key() -> None:
    base = train_config(steps=8, topology="sharded", threads=1)
    exp = build_experiment({"train": {"steps": 8, "topology": "sharded"}, "methods": {
        "sgd": {"downlink_bits": 32},
        "h4-ef2": {"method": "qsgd-4bit", "local_steps": 4, "downlink_bits": 2, "downlink_feedback": True}}})
    sgd, ef = exp.methods
    assert not sgd.train_config(exp.train).downlink_feedback
    assert ef.train_config(exp.train).downlink_feedback and ef.train_config(exp.train).downlink_bits == 2
    tr = Trainer(ef.train_config(base), ef, DATA, 0)
    assert tr.downlink.feedback and tr.downlink.bits == 2
    assert not Trainer(sgd.train_config(base), sgd, DATA, 0).downlink.feedback
    # the row's own feedback on its own fp32 downlink is refused as the [train] key is, naming the key
    bad = build_experiment({"train": {"topology": "sharded"}, "methods": {
        "x": {"method": "qsgd-4bit", "downlink_bits": 32, "downlink_feedback": True}}}).methods[0]
    with pytest.raises(ValueError, match="downlink_feedback"):
        Trainer(bad.train_config(base), bad, DATA, 0)
