"""`dqsgd dq run` into an output that holds another experiment's results is refused (nothing
overwritten) unless --overwrite; the same settings run again; the output is locked while it runs."""

from __future__ import annotations

import json
from pathlib import Path

from dqsgd.dq.cli import main as dq_main

TINY = """[experiment]
name = "tiny"
target = 0.01
baseline = "asyfpg"
[problem]
dataset = "synthetic"
model = "logreg"
[run]
workers = 2
epochs = 1
eval_every = 20
[methods.asyfpg]
"""


def _run(tmp_path: Path, *extra: str) -> int:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    return dq_main(["run", "--config", str(cfg), "--out", str(tmp_path / "runs"), *extra])


def test_dq_run_refuses_an_output_holding_other_settings(tmp_path: Path, capsys) -> None:
    assert _run(tmp_path) == 0
    results = tmp_path / "runs" / "tiny" / "results.json"
    first = results.read_bytes()
    assert _run(tmp_path, "--set", "run.lr=0.1") == 2
    err = capsys.readouterr().err
    assert "holds the results of an experiment with other settings (methods.asyfpg.lr: 0.05 -> 0.1" in err
    assert results.read_bytes() == first
    assert _run(tmp_path, "--set", "run.lr=0.1", "--overwrite") == 0
    assert json.loads(results.read_text())["runs"]["asyfpg"]["config"]["lr"] == 0.1
    from dqsgd.train.runfiles import dir_lock

    with dir_lock(tmp_path / "runs" / "tiny"):
        assert _run(tmp_path) == 2
        assert "is in use by another dqsgd process" in capsys.readouterr().err
