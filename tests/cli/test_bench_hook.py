"""dqsgd bench hook: the ratios it reports, and its command line (the timing itself is not tested)."""

import argparse

import pytest

from dqsgd.cli.bench.hook import summarize
from dqsgd.cli.bench.parser import HOOKS, add_hook_parser


def test_ratios_are_per_round_then_median() -> None:
    times = {"none": [1.0, 2.0, 4.0], "fp16": [1.5, 2.0, 4.4], "qsgd-4bit sharded": [3.0, 2.4, 4.4],
             "qsgd-4bit allgather": [1.0, 2.0, 4.0]}
    rows = {r["hook"]: r for r in summarize(times)}
    assert rows["none"]["ratio"] == 1.0 and rows["none"]["ms"] == 2000.0
    assert rows["fp16"]["ratio"] == pytest.approx(1.1) and rows["fp16"]["max"] == 1.5 and rows["fp16"]["min"] == 1.0
    assert rows["qsgd-4bit sharded"]["ratio"] == pytest.approx(1.2) and rows["qsgd-4bit sharded"]["max"] == 3.0
    assert rows["qsgd-4bit sharded / fp16"]["ratio"] == pytest.approx(1.2)  # 2.0, 1.2, 1.0 against fp16


def test_command_line() -> None:
    parser = argparse.ArgumentParser()
    add_hook_parser(parser.add_subparsers(dest="bench"))
    a = parser.parse_args(["hook", "--model", "cnn", "--hooks", "fp16,dqsgd sharded", "--rounds", "3"])
    assert a.model == "cnn" and a.hooks == "fp16,dqsgd sharded" and a.rounds == 3 and a.world == 2
    assert parser.parse_args(["hook"]).hooks.split(",") == list(HOOKS[1:])


def test_a_subset_of_hooks_gets_only_the_ratios_it_can() -> None:
    rows = {r["hook"] for r in summarize({"none": [1.0], "fp16": [1.1], "qsgd-4bit sharded": [1.3]})}
    assert rows == {"none", "fp16", "qsgd-4bit sharded", "qsgd-4bit sharded / fp16"}
    rows = {r["hook"] for r in summarize({"none": [1.0], "qsgd-4bit allgather": [1.3]})}
    assert rows == {"none", "qsgd-4bit allgather"}
