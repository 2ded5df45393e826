"""The command line's footguns (issue 41): mistakes said before torch loads, a closed pipe, `--methods`
selections, figures without matplotlib, and the run directories' lock files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dqsgd.cli.commands import main

TINY = ["--set", "train.dataset=synthetic", "--set", "train.model=mlp", "--set", "train.steps=4",
        "--set", "train.eval_every=2", "--set", "train.workers=2", "--set", "train.batch_size=8", "--quiet"]

# a fresh interpreter runs the command, then says whether torch was imported
PROBE = """
import json, sys
from dqsgd.cli.commands import main
rc = main(json.loads(sys.argv[1]))
print("TORCH=" + json.dumps("torch" in sys.modules))
sys.exit(rc)
"""


@pytest.mark.parametrize("argv, said", [
    (["train", "--method", "qsgd", "--timeout", "-1"], "--timeout must be in"),
    (["train", "--method", "qsgd", "--max-restarts", "1"], "--max-restarts restarts distributed processes"),
    (["train", "--method", "no-such-method"], "unknown method 'no-such-method'"),
    (["train", "--method", "qsgd", "--set", "train.steps=0"], "steps must be in"),
    (["compare", "--methods", "sgd,no-such-label"], "--methods ['no-such-label'] not in the config"),
    (["compare", "--set", "train.no_such_key=1"], "unknown train key(s) ['no_such_key']"),
    (["report", "/nonexistent/dqsgd-runs"], "no runs"),
])
def test_a_mistake_is_said_before_torch_is_imported(argv: list[str], said: str) -> None:
    res = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert said in res.stderr and "Traceback" not in res.stderr
    assert res.stdout.rsplit("TORCH=", 1)[1].strip() == "false", f"dqsgd {' '.join(argv)} imported torch first"


@pytest.mark.parametrize("command", ["configs", "methods"])
def test_a_closed_pipe_ends_the_listing_quietly(command: str) -> None:
    """`dqsgd configs | head -1`: the reader is gone before the command writes (its end of the pipe is
    closed first, so the write fails every time): no error line, exit 141 (128 + SIGPIPE), as a
    program stopped by the signal."""
    r, w = os.pipe()
    os.close(r)
    try:
        res = subprocess.run([sys.executable, "-m", "dqsgd", command], stdout=w, stderr=subprocess.PIPE, text=True,
                             timeout=120)
    finally:
        os.close(w)
    assert res.returncode == 141 and res.stderr == "", res.stderr


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`compare --methods sgd,qsgd-4bit` of table1-mnist (nine methods), tiny."""
    out = tmp_path_factory.mktemp("cmp") / "two"
    assert main(["compare", *TINY, "--methods", "sgd,qsgd-4bit", "--out", str(out)]) == 0
    return out


def test_compare_methods_does_not_warn_about_the_methods_left_out(compared: Path, capsys) -> None:
    from dqsgd.experiments.summary import write_tables

    assert json.loads((compared / "selection.json").read_text()) == {"methods": ["sgd", "qsgd-4bit"]}
    write_tables(compared)  # what `compare` and `report` call
    assert "missing" not in capsys.readouterr().err
    assert "Left out or incomplete" not in (compared / "report.md").read_text()
    # a selected run that is gone is still said
    gone = compared.parent / "gone"
    import shutil

    shutil.copytree(compared, gone)
    shutil.rmtree(gone / "qsgd-4bit")
    write_tables(gone)
    err = capsys.readouterr().err
    assert "run(s) qsgd-4bit/seed0 of experiment.toml missing" in err and "dqsgd/seed0" not in err


def test_a_second_selection_adds_to_the_first(compared: Path, capsys) -> None:
    import shutil

    out = compared.parent / "more"
    shutil.copytree(compared, out)
    assert main(["compare", *TINY, "--methods", "dqsgd", "--out", str(out)]) == 0
    assert json.loads((out / "selection.json").read_text()) == {"methods": ["sgd", "qsgd-4bit", "dqsgd"]}
    assert "missing" not in capsys.readouterr().err


def _without_matplotlib(argv: list[str]) -> subprocess.CompletedProcess:
    code = f"import sys; sys.modules['matplotlib'] = None\nfrom dqsgd.cli.commands import main\nsys.exit(main({argv!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_compare_and_its_dry_run_need_no_matplotlib(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    res = _without_matplotlib(["compare", *TINY, "--methods", "sgd", "--out", str(out), "--dry-run"])
    assert res.returncode == 0, res.stderr
    assert "figures not drawn" in res.stdout and "pip install 'dqsgd[plots]'" in res.stdout
    res = _without_matplotlib(["compare", *TINY, "--methods", "sgd", "--out", str(out)])
    assert res.returncode == 0, res.stderr
    assert "pip install 'dqsgd[plots]'" in res.stderr and "Traceback" not in res.stderr
    text = (out / "report.md").read_text()
    assert "Figures not drawn" in text and "fig1.png" not in text and not (out / "fig1.png").exists()
    assert (out / "summary.csv").exists()
    res = _without_matplotlib(["report", str(out)])  # the same for `report`
    assert res.returncode == 0 and "pip install 'dqsgd[plots]'" in res.stderr, res.stderr
    assert main(["report", str(out)]) == 0 and (out / "fig1.png").exists()  # with matplotlib: drawn
    assert "![fig1.png](fig1.png)" in (out / "report.md").read_text()


def test_a_finished_run_leaves_no_lock_file(compared: Path) -> None:
    assert not list(compared.rglob(".lock"))


def _hold(path: Path) -> subprocess.Popen:
    code = ("import sys; from pathlib import Path; from dqsgd.train.runfiles import dir_lock; "
            "f = dir_lock(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read(); f.close()")
    p = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_the_lock_of_a_live_process_stays_and_goes_when_it_ends(tmp_path: Path) -> None:
    from dqsgd.train.runfiles import RunDirError, dir_lock, lock_holder

    holder = _hold(tmp_path)
    try:
        with pytest.raises(RunDirError, match=f"pid {holder.pid}"):
            dir_lock(tmp_path)
        assert (tmp_path / ".lock").exists() and lock_holder(tmp_path) == str(holder.pid)
    finally:
        holder.communicate("", timeout=30)
    assert not (tmp_path / ".lock").exists() and lock_holder(tmp_path) is None


def test_a_lock_taken_on_a_removed_file_is_taken_again_on_the_new_one(tmp_path: Path, monkeypatch) -> None:
    """The race of removing a lock file: B opens .lock, its holder A removes it and ends, B locks the
    removed file. B must not count that as holding the directory (a third process would create and
    lock a new .lock): it takes the lock of the file there now, and is then the only holder."""
    from dqsgd.train import runfiles

    a = runfiles.dir_lock(tmp_path)
    stale = runfiles.open_text(tmp_path / ".lock", "a+")  # B's open, before A ends
    a.close()
    assert not (tmp_path / ".lock").exists()
    opened = []
    real = runfiles.open_text

    def first_the_stale_file(path: Path, mode: str):
        opened.append(path)
        return stale if len(opened) == 1 else real(path, mode)

    monkeypatch.setattr(runfiles, "open_text", first_the_stale_file)
    b = runfiles.dir_lock(tmp_path)
    monkeypatch.undo()
    assert len(opened) == 2 and stale.closed
    assert runfiles._is_file_at(b.file, tmp_path / ".lock")
    assert (tmp_path / ".lock").read_text() == str(os.getpid())
    holder_check = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                                   "from dqsgd.train.runfiles import lock_holder; print(lock_holder(Path(sys.argv[1])))",
                                   str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert holder_check.stdout.strip() == str(os.getpid())
    b.close()
    assert not (tmp_path / ".lock").exists()
