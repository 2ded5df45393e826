"""``--dry-run`` of train, compare and dq run: the real command's checks, a plan, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from dqsgd.cli.commands import main

TINY = ["--set", "train.dataset=synthetic", "--set", "train.model=mlp", "--set", "train.steps=4",
        "--set", "train.eval_every=2", "--set", "train.workers=2", "--set", "train.batch_size=8"]


def test_train_dry_run_prints_the_plan_and_writes_nothing(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--method", "dqsgd", *TINY, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "output: runs/train/table1-mnist/dqsgd/seed0 (a new run)" in out
    assert "W = 2, 4 steps" in out and out.rstrip().endswith("dry run: nothing trained, nothing written")
    assert list(tmp_path.iterdir()) == []


def test_compare_dry_run_checks_the_output_directory_like_the_real_run(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cmp"
    args = ["compare", *TINY, "--methods", "sgd,qsgd-4bit", "--out", str(out), "--quiet"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--dry-run"]) == 2  # the runs are there: refused, as the real command would
    assert "already holds runs" in capsys.readouterr().err
    assert main([*args, "--dry-run", "--resume"]) == 0
    assert capsys.readouterr().out.count("kept (finished)") == 2
    assert main([*args, "--dry-run", "--resume", "--set", "train.lr=0.5"]) == 2  # a changed compared key
    assert "train.lr" in capsys.readouterr().err


def test_train_dry_run_checks_the_resume_target(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", "--method", "qsgd-4bit", *TINY, "--out", str(run), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--dry-run"]) == 0
    assert "continue from its newest checkpoint, same config" in capsys.readouterr().out
    assert main(["train", "--resume", str(tmp_path / "nothing"), "--dry-run"]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_torch_dry_run_checks_the_process_count(capsys, monkeypatch) -> None:
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(k, v)
    assert main(["train", "--transport", "torch", "--method", "sgd", *TINY, "--dry-run"]) == 2
    assert "train.workers = 2 but torchrun (WORLD_SIZE) gives 3" in capsys.readouterr().err


@pytest.mark.parametrize("override, ok", [("run.seed=1", True), ("train.seeds=[0]", False)])
def test_dq_dry_run_validates_overrides(override: str, ok: bool, tmp_path: Path, capsys) -> None:
    argv = ["dq", "run", "--config", "dq-mnist-logreg", "--set", "problem.dataset=synthetic",
            "--set", "problem.model=logreg", "--set", "problem.inputs=normalized", "--set", override, "--out", str(tmp_path), "--dry-run"]
    assert main(argv) == (0 if ok else 2)
    if ok:
        assert "dry run: nothing trained, nothing written" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
