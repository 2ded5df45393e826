"""No silent loss and no silent wrong results (run directories, resume, checkpoints, metrics)
and one-line errors (exit code 2) instead of tracebacks for bad input and a failing disk."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dqsgd
from dqsgd.cli.commands import main
from dqsgd.codecs import wire
from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.quantizers import NonFiniteGradientError
from dqsgd.quantizers.lowprec import quantize_lowprec
from dqsgd.train.checkpoint import CheckpointError, CorruptCheckpoint, read_checkpoint
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.metrics import read_jsonl
from dqsgd.train.rundir import RunDirError, open_run
from dqsgd.train.runner import run_one
from dqsgd.train.trainer import Trainer

DATA = load_dataset("synthetic")
BASE = ["--quiet", "--set", 'train.dataset="synthetic"', "--set", 'train.model="mlp"', "--set", "train.workers=2",
        "--set", "train.batch_size=8", "--set", "train.eval_every=4", "--set", "train.threads=1"]


def cfg(**kw) -> TrainConfig:
    base = dict(name="t", dataset="synthetic", model="mlp", workers=2, steps=8, batch_size=8, lr=0.1, eval_every=4,
                seeds=(0,), checkpoint_every=2)
    return TrainConfig(**{**base, **kw})


def qsgd(**kw) -> MethodEntry:
    return MethodEntry("qsgd", method_config("qsgd", **kw))


def train(out: Path, *extra: str, method: str = "qsgd", steps: int = 8) -> int:
    return main(["train", "--method", method, "--out", str(out), *BASE, "--set", f"train.steps={steps}",
                 "--set", "train.checkpoint_every=2", *extra])


def err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


# --- 1. run directories ---------------------------------------------------------------------------
def test_second_writer_refused_naming_the_holder_pid(tmp_path: Path) -> None:
    with open_run(tmp_path / "run"):
        with pytest.raises(RunDirError, match=f"in use by another dqsgd process \\(pid {os.getpid()}\\)"):
            run_one(cfg(), qsgd(), DATA, 0, tmp_path / "run", progress=False)
    run_one(cfg(), qsgd(), DATA, 0, tmp_path / "run", progress=False)  # released: usable again


def test_a_directory_holding_a_run_is_refused_unless_resume_or_overwrite(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert train(run) == 0
    first = (run / "metrics.jsonl").read_text()
    assert train(run, method="sgd") == 2
    assert "already holds a run (method qsgd, seed 0)" in err_line(capsys)
    assert (run / "metrics.jsonl").read_text() == first  # untouched
    assert train(run, "--overwrite", method="sgd") == 0
    assert json.loads((run / "config.json").read_text())["method"] == "sgd"


def test_train_default_output_is_apart_from_the_compare_tree(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--method", "qsgd", *BASE, "--set", "train.steps=2", "--set", 'train.name="t1"']) == 0
    assert (tmp_path / "runs" / "train" / "t1" / "qsgd" / "seed0" / "summary.json").is_file()
    assert not (tmp_path / "runs" / "t1").exists()


def test_report_refuses_runs_whose_configs_differ_naming_the_keys(tmp_path: Path, capsys) -> None:
    root = tmp_path / "cmp"
    assert train(root / "qsgd" / "seed0", steps=4) == 0
    assert train(root / "sgd" / "seed0", method="sgd", steps=6) == 0
    assert main(["report", str(root)]) == 2
    line = err_line(capsys)
    assert "train.steps: 4 -> 6" in line and "report them separately" in line
    assert train(root / "sgd" / "seed0", "--overwrite", method="sgd", steps=4) == 0
    assert main(["report", str(root)]) == 0


# --- 2. resume under a changed configuration ------------------------------------------------------
def test_resume_with_a_changed_config_is_refused_naming_the_keys(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert train(run, steps=4) == 0
    before = (run / "summary.json").read_text()
    code = main(["train", "--resume", str(run), "--quiet", "--set", "methods.qsgd.bits=2", "--set", "train.lr=0.3"])
    assert code == 2
    line = err_line(capsys)
    assert "method.bits: 4 -> 2" in line and "train.lr: 0.02 -> 0.3" in line
    assert (run / "summary.json").read_text() == before
    code = main(["train", "--resume", str(run), "--quiet", "--set", "train.subset=64"])
    line = err_line(capsys)
    assert code == 2 and "train.subset: 0 -> 64" in line and "data: " in line


def test_resume_reads_the_runs_own_config(tmp_path: Path) -> None:
    """Back to the half-way checkpoint, resumed with only --resume: the same records as one uninterrupted run."""
    full, part = tmp_path / "full", tmp_path / "part"
    sets = ["--set", "methods.qsgd.bits=3", "--set", "train.lr=0.2", "--set", "train.checkpoint_every=4"]
    assert train(full, *sets) == 0
    assert train(part, *sets) == 0
    (part / "checkpoint.pt").unlink()  # back to the checkpoint of step 4 (checkpoint.prev.pt)
    (part / "summary.json").unlink()
    assert main(["train", "--resume", str(part), "--quiet"]) == 0  # no --config, --method or --set
    assert json.loads((part / "config.json").read_text())["method_config"]["bits"] == 3
    key = lambda r: (r["step"], r["bits"], r["up_bytes"], r["loss"])
    assert [key(r) for r in read_jsonl(part / "metrics.jsonl")] == [key(r) for r in read_jsonl(full / "metrics.jsonl")]


def test_resume_of_a_missing_directory_is_an_error(tmp_path: Path, capsys) -> None:
    assert main(["train", "--resume", str(tmp_path / "nope"), "--quiet"]) == 2
    assert "no such run directory" in err_line(capsys)
    assert main(["train", "--method", "qsgd", "--config", "table1-mnist", "--resume", str(tmp_path / "nope"),
                 *BASE, "--set", "train.checkpoint_every=2"]) == 2
    assert "no such run directory" in err_line(capsys)
    assert not (tmp_path / "nope").exists()


def test_compare_resume_after_a_config_change_is_refused(tmp_path: Path, capsys) -> None:
    toml = tmp_path / "exp.toml"
    toml.write_text('[train]\nname = "e"\ndataset = "synthetic"\nmodel = "mlp"\nworkers = 2\nsteps = 4\nbatch_size = 8\n'
                    'eval_every = 4\nthreads = 1\n[methods.sgd]\n[methods.qsgd-4bit]\n')
    out = tmp_path / "out"
    args = ["compare", "--config", str(toml), "--out", str(out), "--quiet"]
    assert main(args) == 0
    assert main(args) == 2 and "already holds runs" in err_line(capsys)
    assert (out / "experiment.toml").read_text() == toml.read_text()
    assert main([*args, "--resume"]) == 0  # unchanged: finished runs kept
    assert main([*args, "--resume", "--set", "train.lr=0.3", "--set", "train.workers=4"]) == 2
    line = err_line(capsys)
    assert "train.lr: 0.05 -> 0.3" in line and "train.workers: 2 -> 4" in line


# --- 6. checkpoint integrity ----------------------------------------------------------------------
def test_a_one_bit_flip_in_a_checkpoint_is_refused(tmp_path: Path) -> None:
    run_one(cfg(steps=4), qsgd(), DATA, 0, tmp_path, progress=False)
    raw = bytearray((tmp_path / "checkpoint.pt").read_bytes())
    raw[len(raw) // 2] ^= 0x10  # inside the stored tensors
    (tmp_path / "flipped.pt").write_bytes(bytes(raw))
    tr = Trainer(cfg(steps=4), qsgd(), DATA, 0)
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        read_checkpoint(tr, tmp_path / "flipped.pt")
    assert read_checkpoint(tr, tmp_path / "checkpoint.pt")["next_step"] == 4


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, capsys) -> None:
    full = run_one(cfg(), qsgd(), DATA, 0, tmp_path / "full", progress=False)
    run = tmp_path / "run"
    run_one(cfg(), qsgd(), DATA, 0, run, progress=False)
    raw = bytearray((run / "checkpoint.pt").read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (run / "checkpoint.pt").write_bytes(bytes(raw))  # newest (step 8) damaged; .prev.pt holds step 6
    (run / "summary.json").unlink()
    s = run_one(cfg(), qsgd(), DATA, 0, run, resume=True, progress=False)
    err = capsys.readouterr().err
    assert "checkpoint.pt: checksum mismatch" in err and "falling back to the previous checkpoint" in err
    assert torch.equal(s["final_params"], full["final_params"])
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(8))
    for p in (run / "checkpoint.pt", run / "checkpoint.prev.pt"):
        p.write_bytes(b"x" * 200)
    (run / "summary.json").unlink()  # unfinished again (a finished run is left untouched)
    with pytest.raises(CheckpointError, match="every checkpoint of rank\\(s\\) \\[0\\] is damaged"):
        run_one(cfg(), qsgd(), DATA, 0, run, resume=True, progress=False)


# --- 7. metrics files -----------------------------------------------------------------------------
def test_a_corrupt_middle_line_does_not_drop_later_records_on_resume(tmp_path: Path, capsys) -> None:
    run_one(cfg(), qsgd(), DATA, 0, tmp_path, progress=False)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    lines[2] = lines[2][:15] + "\x00\x00 garbage"
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "checkpoint.pt").unlink()  # resume from .prev.pt: step 6
    (tmp_path / "summary.json").unlink()  # as if stopped before the end
    run_one(cfg(), qsgd(), DATA, 0, tmp_path, resume=True, progress=False)
    assert "metrics.jsonl: skipped line(s) 3" in capsys.readouterr().err
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 3, 4, 5, 6, 7]


def test_report_keeps_every_record_before_a_torn_last_line(tmp_path: Path, capsys) -> None:
    root = tmp_path / "cmp"
    assert train(root / "qsgd" / "seed0") == 0
    with open(root / "qsgd" / "seed0" / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "loss": 0.5, "bi')  # a crash mid-write
    capsys.readouterr()
    assert main(["report", str(root)]) == 0
    assert "metrics.jsonl: skipped line(s) 9" in capsys.readouterr().err
    assert json.loads((root / "summary.json").read_text())["runs"][0]["steps"] == 8


# --- one-line errors, exit code 2 -----------------------------------------------------------------
@pytest.mark.parametrize("extra,msg", [
    (["--timeout", "inf"], "--timeout must be in (0, 604800] seconds"),
    (["--timeout", "nan"], "--timeout must be in (0, 604800] seconds"),
    (["--set", "train.lr=inf"], "train.lr must be a finite number"),
    (["--set", "train.lr=nan"], "train.lr must be a finite number"),
    (["--set", "methods.qsgd.lr=inf"], "methods.qsgd.lr must be a finite number"),
])
def test_bad_numbers_are_refused_in_one_line(extra: list[str], msg: str, tmp_path: Path, capsys) -> None:
    assert train(tmp_path / "run", *extra) == 2
    assert msg in err_line(capsys)


def test_toml_train_that_is_not_a_table_is_refused(tmp_path: Path, capsys) -> None:
    for text, msg in (("train = 5\n", "train must be a table"), ("methods = 5\n", "methods must hold tables")):
        (tmp_path / "bad.toml").write_text(text)
        assert main(["train", "--method", "sgd", "--config", str(tmp_path / "bad.toml")]) == 2
        assert msg in err_line(capsys)


def test_out_that_is_a_file_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "f").write_text("x")
    assert train(tmp_path / "f") == 2
    assert "is a file, not a directory" in err_line(capsys)
    assert main(["compare", "--config", "table1-mnist", *BASE, "--set", "train.steps=2", "--out", str(tmp_path / "f")]) == 2
    assert "is a file, not a directory" in err_line(capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_output_directory_is_one_line(tmp_path: Path, capsys) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert train(ro / "run") == 2
        assert "Permission denied" in err_line(capsys)
    finally:
        ro.chmod(0o755)
    assert not list(ro.rglob("*.tmp"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_leaves_no_tmp_file_behind(code: int, tmp_path: Path, capsys, monkeypatch) -> None:
    """The write of config.json (the first file written through a .tmp) fails: full disk, or remounted read-only."""
    run = tmp_path / "run"
    real = os.fsync

    def failing(fd: int) -> None:
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).endswith(".tmp"):
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    assert train(run) == 2
    assert os.strerror(code) in err_line(capsys)
    assert not list(run.rglob("*.tmp"))


def test_programming_errors_keep_their_traceback(monkeypatch) -> None:
    import dqsgd.cli.commands as cli

    def bug(args):  # a TypeError raised by a bug, not by user input
        return len(5)

    monkeypatch.setattr(cli, "cmd_methods", bug)
    with pytest.raises(TypeError):
        cli.main(["methods"])


# --- norms that overflow float32, forged payloads --------------------------------------------------
def test_finite_inputs_are_never_called_nan_or_inf() -> None:
    with pytest.raises(ValueError, match="beyond the float32 range") as e:
        dqsgd.encode(torch.tensor([1e300, 1.0], dtype=torch.float64))
    assert not isinstance(e.value, NonFiniteGradientError)
    x = torch.full((8,), 3.4e38)
    assert torch.equal(dqsgd.decode(dqsgd.encode(x, scheme="scaled-sign")), x)  # mean |x| is representable
    y = torch.full((16,), 1e20)  # ‖y‖₂ = 4e20, but Σy² = 1.6e41 overflows float32
    assert torch.isfinite(dqsgd.decode(dqsgd.encode(y, norm=2, bits=8))).all()
    with pytest.raises(ValueError, match="l2 norm .* exceeds the float32 range"):
        dqsgd.encode(torch.full((8,), 3e38), norm=2)
    with pytest.raises(NonFiniteGradientError, match="NaN or Inf"):
        dqsgd.encode(torch.tensor([1.0, float("nan")]))


def test_forged_payloads_are_refused_with_valueerror() -> None:
    q = quantize_lowprec(torch.tensor([1.0, -1.0, 0.5, 0.25]), 16)
    with pytest.raises(ValueError, match="beyond float32"):
        dqsgd.decode(wire.encode(dataclasses.replace(q, scales=torch.tensor([3e38]))))
    empty = quantize_lowprec(torch.zeros(0), 4)
    forged = wire.encode(dataclasses.replace(empty, shape=(0, 2**32 - 1, 2**32 - 1, 2**32 - 1)))
    with pytest.raises(ValueError, match="cannot be represented"):
        dqsgd.decode(forged)


# --- signals, environment -------------------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_checkpoint_and_print_the_resume_command(tmp_path: Path, sig: int) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "dqsgd", "train", "--method", "qsgd", "--out", str(run), *BASE,
           "--set", "train.steps=100000", "--set", "train.checkpoint_every=1000"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        t0 = time.monotonic()
        metrics = run / "metrics.jsonl"
        while time.monotonic() - t0 < 120 and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            time.sleep(0.05)  # a few steps done: the loop is running
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"continue with: dqsgd train --resume {run}" in lines[0]
    step = int(lines[0].split("after step ")[1].split(";")[0])
    tr = Trainer(cfg(steps=100000, checkpoint_every=1000, eval_every=4, threads=1), qsgd(), DATA, 0)
    assert read_checkpoint(tr, run / "checkpoint.pt")["next_step"] == step
    assert len(list(read_jsonl(run / "metrics.jsonl"))) == step


def test_config_json_records_the_environment_outside_the_compared_keys(tmp_path: Path) -> None:
    run_one(cfg(steps=2), qsgd(), DATA, 0, tmp_path, progress=False)
    facts = json.loads((tmp_path / "config.json").read_text())
    env = facts["environment"]
    assert env["torch"] == torch.__version__ and env["cpu"] and env["torch_threads"] >= 1 and "numba" in env
    assert not any(k.startswith("environment") for k in facts["resolved"])
    assert "train.eval_every" not in facts["resolved"] and facts["resolved"]["train.lr"] == 0.1
