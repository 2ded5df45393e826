"""write_tables against numbers recomputed by hand from the fixture's own definitions."""

from __future__ import annotations

import csv
import json
import shutil
import statistics
from pathlib import Path

import pytest

from dqsgd.experiments.summary import method_order, write_tables

from fake_runs import D, FINAL_ACC, STEPS, W, bits_of, up_of, write_run

ORDER = ["sgd", "qsgd-4bit", "dqsgd"]  # as in experiment.toml; alphabetical would be dqsgd, qsgd-4bit, sgd


def test_rows_match_hand_computation(root: Path) -> None:
    rows = {r["method"]: r for r in write_tables(root)}
    for m in ORDER:
        accs = [FINAL_ACC[(m, s)] for s in (0, 1)]
        deltas = [FINAL_ACC[(m, s)] - FINAL_ACC[("sgd", s)] for s in (0, 1)]
        up = sum(up_of(m, n) for n in range(STEPS))
        mean_bits = sum(bits_of(m, n) for n in range(STEPS)) / STEPS
        r = rows[m]
        assert r["seeds"] == 2 and r["steps"] == STEPS and r["workers"] == W
        assert r["test_acc_mean"] == pytest.approx(statistics.fmean(accs), abs=1e-12)
        assert r["test_acc_std"] == pytest.approx(statistics.stdev(accs), abs=1e-12)
        assert r["delta_vs_sgd_mean"] == pytest.approx(statistics.fmean(deltas), abs=1e-12)
        assert r["delta_vs_sgd_std"] == pytest.approx(statistics.stdev(deltas), abs=1e-12)
        assert r["measured_ratio"] == pytest.approx(4 * D * W * STEPS / up, rel=1e-12)
        assert r["paper_ratio"] == pytest.approx(32 / mean_bits, rel=1e-12)
        assert r["mean_bits"] == pytest.approx(mean_bits, rel=1e-12)
        assert r["up_bytes"] == up
    # Spot values, so that a wrong helper in the fixture cannot hide a wrong formula.
    assert rows["dqsgd"]["mean_bits"] == 4.5
    assert rows["dqsgd"]["paper_ratio"] == pytest.approx(32 / 4.5)
    assert rows["qsgd-4bit"]["measured_ratio"] == pytest.approx(4 * 1000 / (500 + 16))
    assert rows["sgd"]["delta_vs_sgd_mean"] == 0.0


def test_rows_follow_experiment_toml(root: Path) -> None:
    assert method_order(root) == ORDER
    assert [r["method"] for r in write_tables(root)] == ORDER
    with open(root / "summary.csv", newline="") as f:
        assert [r["method"] for r in csv.DictReader(f)] == ORDER
    data = json.loads((root / "summary.json").read_text())
    assert [r["method"] for r in data["methods"]] == ORDER
    assert [(r["method"], r["seed"]) for r in data["runs"]] == [(m, s) for m in ORDER for s in (0, 1)]


def test_without_toml_first_seen_order_and_extra_methods_last(root: Path) -> None:
    write_run(root, "adaptive", 0, final_acc=0.89)  # a label the toml does not list: after the listed ones
    assert [r["method"] for r in write_tables(root)] == ORDER + ["adaptive"]
    (root / "experiment.toml").unlink()
    assert method_order(root) == []
    # first seen = the sorted run directories
    assert [r["method"] for r in write_tables(root)] == ["adaptive", "dqsgd", "qsgd-4bit", "sgd"]


def test_skipped_steps_and_missing_eval(root: Path) -> None:
    write_run(root, "qsgd-4bit", 1, final_acc=0.905, skipped=(3, 7))
    write_run(root, "dqsgd", 1, final_acc=None)  # still running: no eval line
    rows = {r["method"]: r for r in write_tables(root)}
    kept = [n for n in range(STEPS) if n not in (3, 7)]
    up = [sum(up_of("qsgd-4bit", n) for n in range(STEPS)), sum(up_of("qsgd-4bit", n) for n in kept)]
    ratios = [4 * D * W * STEPS / up[0], 4 * D * W * len(kept) / up[1]]
    assert rows["qsgd-4bit"]["measured_ratio"] == pytest.approx(statistics.fmean(ratios))
    assert rows["dqsgd"]["test_acc_mean"] == pytest.approx(FINAL_ACC[("dqsgd", 0)])  # the evaluated seed only
    assert rows["dqsgd"]["test_acc_std"] == 0.0 and rows["dqsgd"]["seeds"] == 2


def test_no_runs_is_an_error(tmp_path: Path, root: Path) -> None:
    shutil.rmtree(root / "sgd")
    assert "sgd" not in {r["method"] for r in write_tables(root)}
    with pytest.raises(FileNotFoundError, match="no runs"):
        write_tables(tmp_path / "empty")
