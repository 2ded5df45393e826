"""Run directories: no file opened through a planted link, one writer per directory (compare and
report too), a finished run never restarted, an unfinished one without a checkpoint never
silently restarted, and the old files replaced only once a restarted run finishes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dqsgd.cli.commands import main
from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.runner import run_one
from dqsgd.train.trainer import Trainer

BASE = ["--quiet", "--set", 'train.dataset="synthetic"', "--set", 'train.model="mlp"', "--set", "train.workers=2",
        "--set", "train.batch_size=8", "--set", "train.eval_every=4", "--set", "train.threads=1"]


def train(out: Path, *extra: str, steps: int = 8, every: int = 0) -> int:
    return main(["train", "--method", "qsgd", "--out", str(out), *BASE, "--set", f"train.steps={steps}",
                 "--set", f"train.checkpoint_every={every}", *extra])


def compare(out: Path, *extra: str, steps: int = 6, every: int = 2) -> int:
    cfg = out.parent / "exp.toml"
    cfg.write_text('[train]\nname = "c"\n[methods.sgd]\n[methods.qsgd]\nbits = 4\n')
    return main(["compare", "--config", str(cfg), "--out", str(out), *BASE, "--set", f"train.steps={steps}",
                 "--set", f"train.checkpoint_every={every}", *extra])


def err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name != ".lock"}


# --- D6: links planted in a run directory ----------------------------------------------------------
@pytest.mark.parametrize("name", [".lock", "config.json.tmp", "metrics.jsonl", "summary.json.tmp"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_link_in_a_run_dir_is_refused_and_nothing_outside_is_touched(name: str, overwrite: bool, tmp_path: Path,
                                                                       capsys) -> None:
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(outside)
    rc = train(run, *(["--overwrite"] if overwrite else []))
    line = err_line(capsys)
    assert rc == 2
    assert "symbolic link" in line or ("already holds a run" in line and not overwrite), line
    assert outside.read_text() == "keep me\n" and (run / name).is_symlink()


# --- D3: resume of a finished run, of an unfinished run without a checkpoint -----------------------
def test_resume_of_a_finished_run_reports_it_and_touches_nothing(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert train(run) == 0
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert "already finished (8 steps" in capsys.readouterr().out
    assert snapshot(run) == before


def test_an_unfinished_run_without_checkpoint_is_refused_unless_restarted(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert train(run) == 0
    (run / "summary.json").unlink()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")  # killed after 3 steps
    before = snapshot(run)
    assert main(["train", "--resume", str(run), "--quiet"]) == 2
    assert "no checkpoint to continue from" in err_line(capsys) and snapshot(run) == before
    assert main(["train", "--resume", str(run), "--quiet", "--overwrite"]) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 8 and (run / "summary.json").exists()
    assert not (run / ".next").exists()


def test_a_restart_that_fails_leaves_the_old_run_as_it_was(tmp_path: Path, monkeypatch) -> None:
    cfg = TrainConfig(name="t", dataset="synthetic", model="mlp", workers=2, steps=8, batch_size=8, lr=0.1,
                      eval_every=4, seeds=(0,), threads=1)
    entry, data, run = MethodEntry("qsgd", method_config("qsgd")), load_dataset("synthetic"), tmp_path / "run"
    run_one(cfg, entry, data, 0, run, progress=False)
    before = snapshot(run)
    step, calls = Trainer.step, []

    def failing(self):  # noqa: ANN001, ANN202
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("killed")
        return step(self)

    monkeypatch.setattr(Trainer, "step", failing)
    with pytest.raises(RuntimeError, match="killed"):
        run_one(cfg, entry, data, 0, run, progress=False, overwrite=True)
    assert snapshot(run) == before  # summary.json, metrics.jsonl and config.json of the finished run
    monkeypatch.setattr(Trainer, "step", step)
    run_one(cfg, entry, data, 0, run, progress=False, overwrite=True)  # the leftover .next is replaced
    assert not (run / ".next").exists() and (run / "summary.json").exists()


# --- D9: a run made by `compare` resumes under `train` ----------------------------------------------
def test_train_resume_of_a_compare_run(tmp_path: Path, capsys) -> None:
    root = tmp_path / "cmp"
    assert compare(root) == 0
    run = root / "qsgd" / "seed0"
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert "already finished" in capsys.readouterr().out
    (run / "summary.json").unlink()
    (run / "checkpoint.pt").unlink()  # stopped after step 4: resumes from checkpoint.prev.pt
    assert main(["train", "--resume", str(run), "--quiet"]) == 0, err_line(capsys)
    assert json.loads((run / "summary.json").read_text())["steps"] == 6


# --- D15: one comparison per directory; no table of a run in progress --------------------------------
def _hold(path: Path) -> subprocess.Popen:
    path.mkdir(parents=True, exist_ok=True)
    code = ("import sys; from pathlib import Path; from dqsgd.train.runfiles import dir_lock; "
            "f = dir_lock(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_compare_into_the_same_dir_is_refused_at_once(tmp_path: Path, capsys) -> None:
    root = tmp_path / "cmp"
    holder = _hold(root)
    try:
        t0 = time.perf_counter()
        assert compare(root) == 2
        assert f"is in use by another dqsgd process (pid {holder.pid})" in err_line(capsys)
        assert time.perf_counter() - t0 < 30 and not (root / "sgd").exists()
    finally:
        holder.communicate("", timeout=30)


def test_report_refuses_a_directory_being_written(tmp_path: Path, capsys) -> None:
    root = tmp_path / "cmp"
    assert compare(root) == 0
    for busy in (root, root / "qsgd" / "seed0"):
        holder = _hold(busy)
        try:
            assert main(["report", str(root)]) == 2
            assert f"being written by another dqsgd process (pid {holder.pid})" in err_line(capsys)
        finally:
            holder.communicate("", timeout=30)
    assert main(["report", str(root)]) == 0


# --- N2: a finished run whose metrics were cut -------------------------------------------------------
def test_compare_resume_refuses_a_finished_run_with_cut_metrics(tmp_path: Path, capsys) -> None:
    root = tmp_path / "cmp"
    assert compare(root) == 0
    metrics = root / "qsgd" / "seed0" / "metrics.jsonl"
    metrics.write_text("\n".join(metrics.read_text().splitlines()[:2]) + "\n")
    assert compare(root, "--resume") == 2
    line = err_line(capsys)
    assert f"{root / 'qsgd' / 'seed0'}: summary.json says the run finished 6 steps" in line and "holds 2" in line
    assert compare(root, "--resume", "--overwrite") == 0  # re-run, the finished sgd run kept
    assert len(metrics.read_text().splitlines()) == 6


def test_resume_of_a_finished_run_with_checkpoints_reports_it_and_touches_nothing(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert train(run, every=4) == 0
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert "already finished (8 steps" in capsys.readouterr().out
    assert snapshot(run) == before
