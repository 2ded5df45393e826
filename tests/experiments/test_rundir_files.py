"""Cause 2 of issue 40: one reader and writer of run directories (dqsgd.train.runfiles). Every path
component below the output root is checked (no link one level up), only regular files are read (a
FIFO never blocks), every read is bounded and streamed, the numbers read are checked against the
configuration's own ranges, nesting is bounded, and errors name the file and the line."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Iterator

import pytest

from dqsgd.cli.commands import main
from dqsgd.experiments.report import build_report
from dqsgd.train import reader, runfiles

from fake_runs import STEPS, make_root

BASE = ["--quiet", "--set", 'train.dataset="synthetic"', "--set", 'train.model="mlp"', "--set", "train.workers=2",
        "--set", "train.batch_size=8", "--set", "train.eval_every=2", "--set", "train.threads=1",
        "--set", "train.steps=4"]


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


@contextlib.contextmanager
def fifo_feeder(path: Path) -> Iterator[None]:
    """``path`` replaced by a FIFO. A thread keeps opening its write end and closing it at once, so a
    reader that opens the FIFO (the old code) reads an empty file instead of waiting forever; the new
    code never opens it for reading, and the thread is released at the end."""
    path.unlink(missing_ok=True)
    fifo = path.parent.parent / f".fifo-{path.parent.name}-{path.name}"  # a second name: the run may rename path
    os.mkfifo(fifo)
    os.link(fifo, path)
    stop = threading.Event()

    def feed() -> None:
        while not stop.is_set():
            with open(fifo, "wb"):
                pass

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        while t.is_alive():
            fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets a writer blocked in open() return
            t.join(0.5)
            os.close(fd)
        fifo.unlink()


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    return make_root(tmp_path / "runs" / "fake-table1")


# --- E4: a FIFO in a run directory ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["metrics.jsonl", "config.json"])
def test_report_refuses_a_fifo_instead_of_waiting_on_it(name: str, fake: Path, capsys) -> None:
    path = fake / "qsgd-4bit" / "seed0" / name
    with fifo_feeder(path):
        assert main(["report", str(fake)]) == 2
    assert _err(capsys) == (f"dqsgd: error: {path} is a FIFO, not a regular file; a run directory holds only "
                            f"regular files")


def test_train_resume_skips_a_fifo_checkpoint_and_continues_from_the_previous(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r"
    assert main(["train", "--method", "qsgd", "--out", str(out), *BASE, "--set", "train.checkpoint_every=2"]) == 0
    (out / "summary.json").unlink()  # unfinished: --resume continues from a checkpoint
    capsys.readouterr()
    with fifo_feeder(out / "checkpoint.pt"):
        assert main(["train", "--resume", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"{out / 'checkpoint.pt'} is a FIFO, not a regular file" in err
    assert "falling back to the previous checkpoint" in err
    assert (out / "summary.json").is_file()


# --- E5: a link one level above the run directory -----------------------------------------------------
def test_compare_refuses_a_method_directory_that_is_a_link(tmp_path: Path, capsys) -> None:
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "sgd").symlink_to(elsewhere)
    cfg = tmp_path / "exp.toml"
    cfg.write_text('[train]\nname = "c"\n[methods.sgd]\n[methods.qsgd]\nbits = 4\n')
    assert main(["compare", "--config", str(cfg), "--out", str(out), *BASE]) == 2
    assert _err(capsys).startswith(f"dqsgd: error: {out / 'sgd'} is a symbolic link; dqsgd never reads or writes "
                                   f"a run through a link below its output directory {out}")
    assert list(elsewhere.iterdir()) == []


def test_train_refuses_a_default_directory_below_a_link(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "runs" / "train" / "table1-mnist").mkdir(parents=True)
    (tmp_path / "runs" / "train" / "table1-mnist" / "qsgd").symlink_to(elsewhere)
    assert main(["train", "--method", "qsgd", *BASE]) == 2
    assert "runs/train/table1-mnist/qsgd is a symbolic link" in _err(capsys)
    assert list(elsewhere.iterdir()) == []


def test_open_under_refuses_a_link_at_any_level_below_the_root(tmp_path: Path) -> None:
    (tmp_path / "root" / "a").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "f").write_text("x")
    (tmp_path / "root" / "a" / "b").symlink_to(tmp_path / "other")
    with pytest.raises(runfiles.RunDirError, match="a/b is a symbolic link"):
        runfiles.open_under(tmp_path / "root" / "a" / "b" / "f", os.O_RDONLY, root=tmp_path / "root")
    with pytest.raises(runfiles.RunDirError, match="is not inside"):
        runfiles.open_under(tmp_path / "other" / "f", os.O_RDONLY, root=tmp_path / "root")


# --- E6: numbers of config.json checked against the configuration's ranges ---------------------------
@pytest.mark.parametrize("edit,why", [
    (lambda f: f.update(workers=10**30), "field 'workers' is 10"),
    (lambda f: (f.update(workers=10**30), f["train_config"].update(workers=10**30)), "workers must be in 1..4096"),
    (lambda f: f.update(numel=10**30), "numel must be in [1, 2^51]"),
    (lambda f: f["train_config"].update(steps=10**30), "steps must be in 1..10^9"),
    (lambda f: f["method_config"].update(bits=10**30), "method_config: "),
    (lambda f: f.update(budget_bits="many"), "field 'budget_bits' must be null or a finite number"),
])
def test_report_refuses_a_forged_config_outside_the_config_ranges(edit, why: str, fake: Path, capsys) -> None:
    path = fake / "dqsgd" / "seed1" / "config.json"
    facts = json.loads(path.read_text())
    edit(facts)
    path.write_text(json.dumps(facts))
    assert main(["report", str(fake)]) == 2
    line = _err(capsys)
    assert line.startswith(f"dqsgd: error: {path}: ") and why in line, line


# --- M2: bounded reads --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["metrics.jsonl", "config.json"])
def test_report_refuses_a_file_linked_to_dev_zero(name: str, fake: Path, capsys) -> None:
    path = fake / "sgd" / "seed0" / name
    path.unlink()
    path.symlink_to("/dev/zero")
    assert main(["report", str(fake)]) == 2
    assert _err(capsys).startswith(f"dqsgd: error: {path} is a symbolic link")


def test_report_refuses_a_line_beyond_the_line_cap_naming_file_and_line(fake: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(runfiles, "MAX_LINE_BYTES", 4096)  # the cap (1 MiB) lowered: a small file reaches it
    path = fake / "sgd" / "seed0" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = '{"step": 2, "pad": "' + "x" * 5000 + '"}'  # one line of 5 kB (as a 1.5 GB single line would be)
    path.write_text("\n".join(lines) + "\n")
    assert main(["report", str(fake)]) == 2
    assert _err(capsys) == (f"dqsgd: error: {path}:3: a line longer than 4096 bytes; no run writes one "
                            f"(a damaged file?)")


def test_report_refuses_a_json_file_beyond_its_cap_before_reading_it(fake: Path, capsys) -> None:
    path = fake / "sgd" / "seed0" / "config.json"
    with open(path, "r+b") as f:
        f.truncate(runfiles.MAX_FILE_BYTES + 1)  # sparse: nothing is written to disk
    assert main(["report", str(fake)]) == 2
    assert _err(capsys).startswith(f"dqsgd: error: {path} holds {runfiles.MAX_FILE_BYTES + 1} bytes, more than")


# --- M3: a step beyond the run's steps -----------------------------------------------------------------
def test_report_refuses_a_step_beyond_train_steps(fake: Path, capsys) -> None:
    path = fake / "dqsgd" / "seed0" / "metrics.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    recs[4]["step"] = 10**7  # 10^9 asked the old figures for 7.45 GiB (one column per step number)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["report", str(fake)]) == 2
    assert _err(capsys) == (f"dqsgd: error: {path}:5: field 'step' must be in [0, {STEPS - 1}], got 10000000 "
                            f"(train.steps = {STEPS})")


def test_figure_columns_follow_the_records_not_the_step_numbers() -> None:
    import numpy as np

    from dqsgd.experiments.plots import _by_step

    x, mean, _ = _by_step([None, None], [np.array([1.0, 2.0]), np.array([3.0])],
                          [np.array([0, 10**12]), np.array([10**12])])
    assert x.tolist() == [0, 10**12] and mean.tolist() == [1.0, 2.5]


# --- M4: nesting bounded -----------------------------------------------------------------------------------
def test_report_refuses_a_deeply_nested_experiment_toml(fake: Path, capsys) -> None:
    path = fake / "experiment.toml"
    path.write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert main(["report", str(fake)]) == 2
    assert _err(capsys) == f"dqsgd: error: {path}: arrays or tables nested too deep to read"


# --- L15: records streamed -----------------------------------------------------------------------------------
def test_report_never_holds_a_runs_records_at_once(fake: Path, monkeypatch) -> None:
    class Tracked(dict):
        alive = peak = 0

        def __init__(self, rec: dict) -> None:
            super().__init__(rec)
            Tracked.alive += 1
            Tracked.peak = max(Tracked.peak, Tracked.alive)

        def __del__(self) -> None:
            Tracked.alive -= 1

    check = reader.check_record
    monkeypatch.setattr(reader, "check_record", lambda rec, where, *a: Tracked(check(rec, where, *a)))
    build_report(fake)
    assert Tracked.alive == 0 and 1 <= Tracked.peak <= 3, Tracked.peak  # of STEPS = 40 records per run


# --- L7: a number Python refuses names the file and line ----------------------------------------------------
def test_report_names_file_and_line_of_an_integer_too_long(fake: Path, capsys) -> None:
    path = fake / "sgd" / "seed1" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = lines[1].replace('"step": 1', '"step": ' + "9" * 5001)
    path.write_text("\n".join(lines) + "\n")
    assert main(["report", str(fake)]) == 2
    assert _err(capsys).startswith(f"dqsgd: error: {path}:2: unreadable number (Exceeds the limit (4300")


# --- L11: --transport torch --resume of a finished run ----------------------------------------------------
def test_torch_resume_of_a_finished_run_reports_it_like_the_simulation(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r"
    assert main(["train", "--method", "qsgd", "--out", str(out), *BASE, "--set", "train.checkpoint_every=2"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--transport", "torch", "--workers", "2", "--quiet"]) == 0
    said = capsys.readouterr().out
    assert f"dqsgd: {out} already finished (4 steps, method qsgd, seed 0); nothing to do (left untouched)" in said
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"} == before
