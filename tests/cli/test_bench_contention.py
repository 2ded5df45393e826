"""``dqsgd bench step --contention``'s plumbing (not its timing): the job it runs is a valid ``dqsgd
train`` command, its environment carries the chosen OpenMP wait policy, the busy loops are started and
all killed, a failing job is reported, the figures are printed and written. And the ``dqsgd`` command's
own process setting: OMP_WAIT_POLICY=PASSIVE reaches torch's OpenMP when the command starts it, a value
the user set is kept, and importing dqsgd sets nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dqsgd.cli.bench import contention
from dqsgd.cli.bench.parser import parse_args
from dqsgd.cli.commands import parser as dqsgd_parser

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _children() -> set[int]:
    """This process's live child processes (Linux /proc)."""
    kids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        kids |= {int(p) for p in (task / "children").read_text().split()}
    return {p for p in kids if Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[0] != "Z"}


def _args(tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    return parse_args(["bench", "step", "--contention", "--steps", "3", "--busy", "2", "--threads", "0",
                       "--out", str(tmp_path / "c.json"), "--set", 'train.dataset="synthetic"', *extra])


def test_the_job_is_a_dqsgd_train_command_of_the_options(tmp_path: Path) -> None:
    args = _args(tmp_path, "--method", "qsgd-4bit", "--config", "table1-fashion")
    cmd = contention.job_command(args, tmp_path / "run")
    assert cmd[:2] == [sys.executable, "-c"] and "import sys, torch" in cmd[2]  # torch first: the env is the bench's
    job = dqsgd_parser().parse_args(cmd[3:])
    assert (job.command, job.config, job.method, job.out, job.quiet) == (
        "train", "table1-fashion", "qsgd-4bit", str(tmp_path / "run"), True)
    assert job.set == ["train.steps=3", "train.eval_every=3", "train.threads=0", "train.checkpoint_every=0",
                       'train.dataset="synthetic"']


def test_the_wait_policy_is_set_or_left_unset_as_asked() -> None:
    env = {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE"}
    assert contention.job_environment("passive", env) == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert contention.job_environment("openmp-default", env) == {"PATH": "/bin"}
    with pytest.raises(SystemExit):
        parse_args(["bench", "step", "--contention", "--wait-policy", "spin"])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc to see the child processes")
def test_it_runs_quiet_then_loaded_kills_its_loops_and_writes_the_figures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "siblings"
    probe = [sys.executable, "-c", f"import os, pathlib; ppid = os.getppid(); kids = set(); "
             f"[kids.update(t.joinpath('children').read_text().split()) for t in pathlib.Path(f'/proc/{{ppid}}/task').iterdir()]; "
             f"open({str(log)!r}, 'a').write(f\"{{len(kids - {{str(os.getpid())}})}} {{os.environ.get('OMP_WAIT_POLICY')}}\\n\")"]
    monkeypatch.setattr(contention, "job_command", lambda args, out: probe)
    before = _children()
    result = contention.bench_contention(_args(tmp_path, "--repeats", "2"))
    others = len(before)  # (other children of this process, if any, are siblings too)
    assert log.read_text().split("\n")[:-1] == [f"{others + n} PASSIVE" for n in (0, 2, 0, 2)]  # quiet, 2 loops, ...
    assert _children() == before  # every loop was killed and reaped
    assert [r["run"] for r in result["rows"]] == ["quiet", "2 busy loops"] * 2
    assert all(r["cpu_s"] >= 0 and r["wall_s"] > 0 and r["cpu_s"] == r["user_s"] + r["sys_s"] for r in result["rows"])
    assert result["wall_target"] == (result["cpus"] + 2) / result["cpus"] and result["cpu_target"] == 1.2
    assert json.loads((tmp_path / "c.json").read_text())["rows"] == result["rows"]
    out = capsys.readouterr().out
    assert "loaded / quiet (medians): CPU time x" in out and "OMP_WAIT_POLICY PASSIVE" in out


def test_a_failing_job_is_reported_with_its_error_and_kills_the_loops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fail = [sys.executable, "-c", "import sys; sys.exit('no such config: x')"]
    monkeypatch.setattr(contention, "job_command", lambda args, out: fail)
    before = _children()
    with pytest.raises(SystemExit, match=r"the job failed \(exit 1\):\nno such config: x"):
        contention.bench_contention(_args(tmp_path, "--busy", "1"))
    assert _children() == before and not (tmp_path / "c.json").exists()
    with pytest.raises(SystemExit, match="must be >= 1"):
        contention.bench_contention(_args(tmp_path, "--busy", "0"))


def _omp_env_seen(code: str, **env: str) -> str:
    """How long libgomp's idle threads spin (GOMP_SPINCOUNT; OMP_DISPLAY_ENV=VERBOSE prints what it read at
    load: 300000 with OMP_WAIT_POLICY unset, 0 with PASSIVE) and the output, of a fresh process running ``code``."""
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = subprocess.run([sys.executable, "-c", code], env={**base, "PYTHONPATH": SRC, "OMP_DISPLAY_ENV": "VERBOSE", **env},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout + run.stderr


def test_the_dqsgd_command_makes_idle_openmp_threads_sleep_and_importing_dqsgd_does_not() -> None:
    command = "from dqsgd.cli.commands import main; main(['methods']); import torch; torch.ones(1)"
    assert "GOMP_SPINCOUNT = '0'" in _omp_env_seen(command)  # idle threads sleep at once
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in _omp_env_seen(command, OMP_WAIT_POLICY="ACTIVE")  # the user's kept
    library = ("import os, dqsgd, dqsgd.ddp, dqsgd.train.trainer, torch; dqsgd.encode(torch.ones(9), scheme='uniform',"
               " bits=4); print('set' if 'OMP_WAIT_POLICY' in os.environ else 'unset')")
    seen = _omp_env_seen(library)
    assert "unset" in seen.split() and "GOMP_SPINCOUNT = '300000'" in seen  # OpenMP's own default: untouched
