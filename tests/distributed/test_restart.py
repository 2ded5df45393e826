"""Crash and restart of distributed runs: a rank is SIGKILLed mid-run, the processes restart (torchrun's
--max-restarts, or dqsgd's own for locally started processes) and resume from the per-rank checkpoints;
the run must end exactly as an uninterrupted one (same widths, bytes, ledger, accuracy, final model)."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dqsgd.cli import main
from dqsgd.train.checkpoint import seal
from dqsgd.train.metrics import read_jsonl

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")]

STEPS = 160  # bitwise equality holds at any length; 160 leaves 110 steps after the kill at 50
ARGS = ["--config", "table1-mnist", "--method", "dqsgd", "--quiet", "--set", 'train.dataset="synthetic"',
        "--set", 'train.model="mlp"', "--set", f"train.steps={STEPS}", "--set", "train.workers=2",
        "--set", "train.batch_size=16", "--set", "train.checkpoint_every=10", "--set", "train.eval_every=50",
        "--set", "train.threads=1", "--set", 'train.topology="sharded"']  # the torch transport's default, simulated too
DQSGD = [sys.executable, "-m", "dqsgd", "train"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        todo += kids
    return found


def _is_rank(pid: int) -> bool:
    """A training rank: a torchrun worker (RANK in its environment) or a spawned dqsgd process."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return any(e.startswith(b"RANK=") for e in env) or b"spawn_main" in cmd


def _kill_a_rank_mid_run(proc: subprocess.Popen, run: Path, after: int) -> int:
    """SIGKILL one rank (chosen at random) once ``run`` has checkpoints and ``after`` metric lines.

    No wall-clock cap of its own: on a loaded machine the run may take long to get there; the test's
    timeout bounds the wait, and a run that ends first fails the assertion below."""
    while True:
        ck = run / "checkpoint-rank0.pt"
        lines = sum(1 for _ in open(run / "metrics.jsonl")) if (run / "metrics.jsonl").exists() else 0
        ranks = [p for p in _children(proc.pid) if _is_rank(p)]
        if ck.exists() and lines >= after and len(ranks) == 2:
            os.kill(random.Random(lines).choice(ranks), signal.SIGKILL)
            return lines
        assert proc.poll() is None, "the run ended before a rank could be killed"
        time.sleep(0.02)


def _same_run(full: Path, run: Path, ref_checkpoint: str) -> None:
    key = lambda r: (r["step"], r["bits"], r["up_bytes"], r["down_bytes"], r["budget_left"], r["loss"], r.get("test_acc"))
    a, b = list(read_jsonl(full / "metrics.jsonl")), list(read_jsonl(run / "metrics.jsonl"))
    assert [r["step"] for r in b] == list(range(STEPS))  # each step exactly once, none lost or repeated
    assert [key(r) for r in b] == [key(r) for r in a]
    m0 = torch.load(full / ref_checkpoint, weights_only=True)["model"]
    m1 = torch.load(run / "checkpoint-rank0.pt", weights_only=True)["model"]
    m2 = torch.load(run / "checkpoint-rank1.pt", weights_only=True)["model"]
    for k in m0:
        assert torch.equal(m0[k], m1[k]) and torch.equal(m1[k], m2[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run in simulation, never interrupted (simulation == processes bitwise, tested elsewhere),
    run in this process (one thread, as the ranks; a fresh interpreter would add only its imports)."""
    out = tmp_path_factory.mktemp("reference")
    assert main(["train", *ARGS, "--out", str(out)]) == 0
    return out


@pytest.mark.timeout(600)
def test_torchrun_max_restarts_resumes_exactly_after_a_rank_is_killed(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "-m", "dqsgd", "train", "--transport", "torch", "--timeout", "20", *ARGS, "--out", str(run)]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        killed_at = _kill_a_rank_mid_run(proc, run, after=50)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert killed_at < STEPS
    # torchrun saw a rank fail (the killed one, -9, or a survivor's TransportError first), restarted, finished.
    assert re.search(r"failed \(exitcode: (-9|1)\)", err), err[-3000:]
    assert out.count("W = 2 processes") == 1
    _same_run(reference, run, "checkpoint.pt")


@pytest.fixture(scope="module")
def local_restarted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """`dqsgd train --workers 2 --max-restarts 1` with a rank SIGKILLed mid-run: (run dir, exit code, stderr)."""
    run = tmp_path_factory.mktemp("local") / "run"
    cmd = DQSGD + ["--transport", "torch", "--workers", "2", "--max-restarts", "1", "--timeout", "10", *ARGS,
                   "--out", str(run)]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _kill_a_rank_mid_run(proc, run, after=50)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    return run, proc.returncode, err


@pytest.mark.timeout(600)
def test_local_max_restarts_resumes_exactly_after_a_rank_is_killed(reference: Path,
                                                                    local_restarted: tuple[Path, int, str]) -> None:
    run, code, err = local_restarted
    assert code == 0, err[-3000:]
    assert "died from signal SIGKILL" in err and "restarting all 2 processes" in err, err[-3000:]
    _same_run(reference, run, "checkpoint.pt")


@pytest.mark.timeout(600)
def test_resume_picks_the_newest_step_every_rank_holds(reference: Path, local_restarted: tuple[Path, int, str],
                                                       tmp_path: Path) -> None:
    """A crash between two ranks' saves: rank 0 holds steps (160, 150), rank 1 only (150, 140).
    The resume must use 150 on both ranks, not mix 160 and 150. It starts from a copy of the finished
    2-process run of the test above (each rank's checkpoints of steps 160 and 150)."""
    assert local_restarted[1] == 0, local_restarted[2][-3000:]
    run = tmp_path / "run"
    shutil.copytree(local_restarted[0], run)
    r1 = run / "checkpoint-rank1.pt"
    ck = torch.load(r1, weights_only=True)
    assert ck["next_step"] == STEPS
    # Roll rank 1 back one save: its previous file becomes current; an older step becomes previous.
    prev = torch.load(run / "checkpoint-rank1.prev.pt", weights_only=True)
    older = seal({**prev, "next_step": STEPS - 20})  # a valid (sealed) checkpoint of an older step
    torch.save(prev, r1)
    torch.save(older, run / "checkpoint-rank1.prev.pt")
    (run / "summary.json").unlink()  # the crash came before the end (a finished run is left untouched)
    subprocess.run(DQSGD + ["--transport", "torch", "--workers", "2", "--timeout", "20", *ARGS, "--resume", str(run)],
                   check=True, env=ENV, timeout=150)
    _same_run(reference, run, "checkpoint.pt")

    # Ranks with no step in common cannot resume exactly: a clear error, no training.
    for name in ("checkpoint-rank1.pt", "checkpoint-rank1.prev.pt"):
        c = torch.load(run / name, weights_only=True)
        torch.save(seal({**c, "next_step": c["next_step"] - 100}), run / name)
    (run / "summary.json").unlink()
    p = subprocess.run(DQSGD + ["--transport", "torch", "--workers", "2", "--timeout", "20", *ARGS, "--resume", str(run)],
                       env=ENV, timeout=150, capture_output=True, text=True)
    assert p.returncode != 0 and "no step in common; cannot resume exactly" in p.stderr, p.stderr[-2000:]
