"""`dqsgd train --transport torch` end to end, and the launcher's refusals."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dqsgd.cli.commands import main
from dqsgd.train.metrics import read_jsonl

pytestmark = pytest.mark.distributed

SMALL = ["--config", "table1-mnist", "--method", "dqsgd", "--set", 'train.dataset="synthetic"',
         "--set", 'train.model="mlp"', "--set", "train.steps=5", "--quiet"]


@pytest.mark.timeout(120)
def test_cli_trains_with_two_processes(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "dqsgd", "train", "--transport", "torch", "--topology", "ps", "--workers", "2",
           "--timeout", "30", *SMALL, "--set", "train.workers=2", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "W = 2 processes, ps topology" in p.stdout
    rows = list(read_jsonl(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(5)) and "test_acc" in rows[-1]
    assert all(r["up_bytes"] > 0 for r in rows)  # the server measured both workers' payloads
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["steps"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "metrics.jsonl", "summary.json"]


@pytest.mark.timeout(120)
def test_torchrun_single_host_allgather(tmp_path: Path) -> None:
    """The documented `torchrun --standalone --nproc-per-node N -m dqsgd train --transport torch ...` path
    (env:// rendezvous; --standalone: a free port, so parallel runs on one host do not collide)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dqsgd", "train",
           "--transport", "torch", "--topology", "allgather", "--timeout", "30", *SMALL, "--set", "train.workers=2",
           "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("W = 2 processes, allgather topology") == 1  # only rank 0 reports
    assert len(list(read_jsonl(tmp_path / "metrics.jsonl"))) == 5


def test_world_size_must_match_train_workers(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(["train", "--transport", "torch", "--workers", "2", *SMALL, "--out", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "train.workers = 8 but --workers gives 2 processes" in err and "--set train.workers=2" in err
    assert not any(tmp_path.iterdir())


def test_restarts_and_timeout_are_checked(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["train", "--transport", "torch", "--max-restarts", "1", *SMALL, "--set", "train.workers=2"]) == 2
    assert "restarting needs checkpoints" in capsys.readouterr().err
    assert main(["train", "--max-restarts", "1", *SMALL]) == 2
    assert "it needs --transport torch" in capsys.readouterr().err
    assert main(["train", "--transport", "torch", "--max-restarts", "-1", *SMALL, "--set", "train.workers=2"]) == 2
    assert "--max-restarts must be >= 0" in capsys.readouterr().err
    assert main(["train", "--transport", "torch", "--timeout", "0", *SMALL, "--set", "train.workers=2"]) == 2
    assert "--timeout must be in (0, 604800]" in capsys.readouterr().err
