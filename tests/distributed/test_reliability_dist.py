"""Reliability across processes (gloo on 127.0.0.1, explicit timeouts): ranks that disagree refuse to start,
a non-finite gradient on one rank is skipped or refused by every rank, ranks die with their launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _ranks_reliab
import pytest
import torch
from test_restart import _children, _is_rank

from dqsgd.cli.launch import spawn_local
from dqsgd.train.rundir import open_run

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")]
TIMEOUT = 30.0


def test_ranks_given_different_lr_refuse_to_start_naming_the_key(tmp_path: Path) -> None:
    results = spawn_local(_ranks_reliab.run_with_lr, 2, ([0.02, 0.5], str(tmp_path / "run")), timeout=TIMEOUT,
                          deadline=120)
    assert not any(r.ok for r in results)
    for r in results:
        assert "RankDisagreement" in r.error and "train.lr (rank(s) [1] differ from rank 0" in r.error, r.describe()
        assert "hung" not in r.describe()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step


def test_a_locked_run_directory_stops_every_rank_at_once(tmp_path: Path) -> None:
    """Rank 0 is refused the directory (another writer holds it); rank 1 learns it from the start-up exchange."""
    with open_run(tmp_path / "run"):  # (a rank left waiting would fail with a TransportError timeout instead)
        results = spawn_local(_ranks_reliab.run_into, 2, (str(tmp_path / "run"),), timeout=TIMEOUT, deadline=120)
    assert results[0].error.startswith("RunDirError") and f"in use by another dqsgd process (pid {os.getpid()})" in results[0].error
    assert results[1].error.startswith("RankDisagreement") and "rank(s) [0] refused the run directory" in results[1].error


def test_nonfinite_gradient_on_one_rank_is_skipped_by_every_rank() -> None:
    results = spawn_local(_ranks_reliab.nan_on_one_rank, 2, ("skip", 1, 2), timeout=TIMEOUT, deadline=120)
    assert all(r.ok for r in results), [r.describe() for r in results]
    assert [r.value["skipped"] for r in results] == [1, 1]
    assert torch.equal(results[0].value["params"], results[1].value["params"])


def test_nonfinite_gradient_on_one_rank_stops_every_rank_with_a_clear_error() -> None:
    results = spawn_local(_ranks_reliab.nan_on_one_rank, 2, ("raise", 1, 2), timeout=TIMEOUT, deadline=120)
    for r in results:  # each its own clear error, never a TransportError (a timeout, or a peer that crashed)
        assert not r.ok and r.error.startswith("NonFiniteGradientError") and "step 2" in r.error, r.describe()


def test_ranks_exit_when_their_launcher_is_killed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "dqsgd", "train", "--transport", "torch", "--workers", "2", "--method", "qsgd",
           "--quiet", "--out", str(run), "--set", 'train.dataset="synthetic"', "--set", 'train.model="mlp"',
           "--set", "train.workers=2", "--set", "train.steps=1000000", "--set", "train.batch_size=8",
           "--set", "train.eval_every=1000", "--set", "train.threads=1", "--timeout", "300"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        t0 = time.monotonic()
        metrics = run / "metrics.jsonl"
        while time.monotonic() - t0 < 120 and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            time.sleep(0.1)
        ranks = [p for p in _children(proc.pid) if _is_rank(p)]
        assert len(ranks) == 2, "the ranks did not start"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20 and any(_alive(p) for p in ranks):
            time.sleep(0.1)
        alive = [p for p in ranks if _alive(p)]
    finally:
        proc.kill()
    for p in alive:  # leave nothing behind, whatever the outcome
        os.kill(p, signal.SIGKILL)
    assert not alive, f"ranks {alive} outlived their launcher"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
