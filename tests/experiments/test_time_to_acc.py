"""Time-to-accuracy tables from runs' metrics: the first evaluation reaching the target, paired speed-ups."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dqsgd.experiments.time_to_acc import main, seed_times, table, time_to_accuracy


def _run(root: Path, seed: int, curve: list[tuple[float, float | None]], finished: bool = True) -> None:
    d = root / f"seed{seed}"
    d.mkdir(parents=True)
    with (d / "metrics.jsonl").open("w") as f:
        for step, (t, acc) in enumerate(curve):
            rec = {"step": step, "sim_time_s": t, **({} if acc is None else {"test_acc": acc})}
            f.write(json.dumps(rec) + "\n")
    if finished:
        (d / "summary.json").write_text("{}")


def test_first_evaluation_reaching_the_target(tmp_path: Path) -> None:
    _run(tmp_path / "a", 0, [(1.0, None), (2.0, 0.5), (3.0, None), (4.0, 0.8), (5.0, 0.9)])
    assert time_to_accuracy(tmp_path / "a" / "seed0" / "metrics.jsonl", 0.75) == 4.0
    assert math.isinf(time_to_accuracy(tmp_path / "a" / "seed0" / "metrics.jsonl", 0.95))


def test_running_seeds_count_once_there_and_speedups_are_paired(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for s, (tb, tv) in enumerate([(10.0, 5.0), (12.0, 4.0)]):
        _run(tmp_path / "base", s, [(tb, 0.8)])
        _run(tmp_path / "fast", s, [(tv, 0.8)])
    _run(tmp_path / "fast", 2, [(1.0, 0.7)], finished=False)  # running, not there yet: left out
    _run(tmp_path / "fast", 3, [(1.0, 0.8)], finished=False)  # running, there already: counted
    assert seed_times(tmp_path / "fast", 0.75) == {0: 5.0, 1: 4.0, 3: 1.0}
    text = table([("base", tmp_path / "base"), ("fast", tmp_path / "fast")], 0.75)
    # speed-ups 2 and 3: mean 2.5, t(1) = 12.706, sd = 0.7071: half-width 6.353
    assert "| fast | 3/3 reached | 3.3 [" in text and "2.50× [-3.85, 8.85]" in text
    main(["--target", "0.75", f"base={tmp_path / 'base'}", f"fast={tmp_path / 'fast'}"])
    assert capsys.readouterr().out.strip() == text


def test_never_reached_prints_a_dash(tmp_path: Path) -> None:
    _run(tmp_path / "base", 0, [(1.0, 0.8)])
    _run(tmp_path / "slow", 0, [(1.0, 0.5)])
    text = table([("base", tmp_path / "base"), ("slow", tmp_path / "slow")], 0.75)
    assert text.splitlines()[-1] == "| slow | 0/1 reached | — | — |"
