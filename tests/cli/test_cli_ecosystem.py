"""The command line as a user meets it: light imports, --version, `dqsgd dq`, bench help, errors, progress."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

import dqsgd
from dqsgd.cli.commands import main, parser

HEAVY = ("torch", "numba", "matplotlib", "tqdm", "zstandard", "tensorboard")
PROBE = """
import json, sys
import dqsgd.cli.commands
try:
    dqsgd.cli.commands.main(json.loads(sys.argv[1]))
except SystemExit:
    pass
print("MODULES=" + json.dumps([m for m in {heavy!r} if m in sys.modules]))
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["methods"], ["configs"], ["dq", "--help"],
                                  ["dq", "run", "--help"], ["bench", "--help"], ["bench", "codec", "--help"],
                                  ["train", "--help"], ["compare", "--help"]])
def test_help_level_commands_import_no_heavy_module(argv: list[str]) -> None:
    res = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), json.dumps(argv)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    loaded = json.loads(res.stdout.rsplit("MODULES=", 1)[1])
    assert loaded == [], f"dqsgd {' '.join(argv)} imported {loaded}"


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"dqsgd {dqsgd.__version__}"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_dq_is_a_normal_subcommand(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["dq", flag])
    assert e.value.code == 0 and "usage: dqsgd dq" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["dq", "run", flag])
    out = capsys.readouterr().out
    assert "usage: dqsgd dq run" in out and "--set" in out and "-o " not in out


def test_dq_set_and_hidden_o_alias_reach_the_config(capsys) -> None:
    args = parser().parse_args(["dq", "run", "--set", "run.lr=0.1", "-o", "problem.subset=200"])
    assert args.overrides == ["run.lr=0.1", "problem.subset=200"]
    assert main(["dq", "run", "--config", "dq-mnist-logreg", "--set", "run.no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    acts = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(acts[0].choices) if acts else {}


def test_bench_help_describes_every_option() -> None:
    bench = _subparsers(parser())["bench"]
    for name, sp in _subparsers(bench).items():
        if name == "network":  # forwards everything to its script, which has its own --help
            continue
        for a in sp._actions:
            if not isinstance(a, argparse._HelpAction):
                assert a.help and a.help.strip(), f"dqsgd bench {name} {a.option_strings}: no help text"


def test_cifar_error_points_to_the_data_root_override(capsys) -> None:
    assert main(["train", "--method", "sgd", "--set", "train.dataset=cifar10", "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "--set train.data_root=" in err


def test_workers_follow_torchrun_world_size_unless_set(monkeypatch, capsys) -> None:
    from dqsgd.cli.launch import _check_world, workers_from_world_size
    from dqsgd.train.config import ConfigError, load_experiment

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    exp = load_experiment("table1-mnist")
    assert exp.train.workers == 8
    assert workers_from_world_size(exp, []).train.workers == 3
    assert "WORLD_SIZE" in capsys.readouterr().err
    explicit = load_experiment("table1-mnist", ["train.workers=8"])
    kept = workers_from_world_size(explicit, ["train.workers=8"])
    assert kept.train.workers == 8
    with pytest.raises(ConfigError, match="train.workers"):
        _check_world(kept, 3, "torchrun (WORLD_SIZE)")


def _without(module: str, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in which ``module`` cannot be imported (as if not installed)."""
    return subprocess.run([sys.executable, "-c", f"import sys; sys.modules[{module!r}] = None\n{code}"],
                          capture_output=True, text=True, timeout=120)


def test_missing_plots_extra_is_a_clear_error() -> None:
    res = _without("matplotlib", "from dqsgd.experiments.plots import new_figure; new_figure()")
    assert res.returncode == 1 and "pip install 'dqsgd[plots]'" in res.stderr


def test_missing_tqdm_runs_without_bars_and_says_so() -> None:
    res = _without("tqdm", "from dqsgd.train.progress import step_bar\n"
                           "b = step_bar(10, 0, 'x', True); b.update(3); b.set_postfix_str('y'); b.close()")
    assert res.returncode == 0, res.stderr
    assert "pip install 'dqsgd[cli]'" in res.stderr


def test_compare_shows_run_k_of_n_eta_results_and_evaluations(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dqsgd", "compare", "--config", "table1-mnist", "--out", str(out),
           "--set", "train.dataset=synthetic", "--set", "train.model=mlp", "--set", "train.steps=6",
           "--set", "train.eval_every=3", "--set", "train.workers=2", "--set", "train.batch_size=8",
           "--methods", "sgd,qsgd-4bit"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    text = res.stdout + res.stderr
    assert "[1/2] sgd seed 0: test acc" in text and "[2/2] qsgd-4bit seed 0: test acc" in text
    assert "ETA" in text and "elapsed" in text
    # not a terminal: one plain line per run and one at the end; no bars, no evaluation lines
    assert "\r" not in text and "\x1b[" not in text and "eval at step" not in text
    assert text.count("compare: 2 of 2 runs in ") == 1
    # --resume keeps both runs and says so, run by run
    res = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "[2/2] qsgd-4bit seed 0: finished earlier, kept" in res.stdout + res.stderr


def test_on_a_terminal_bars_show_and_end_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from dqsgd.train import progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out, err = Terminal(), Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    done = dict(method="sgd", seed=0, test_acc=0.9, ledger_compression_ratio=1.0, ledger_mean_bits=32.0, wall_s=1.0)
    bars = progress.CompareProgress(2)
    for _ in range(2):
        bar = progress.step_bar(5, 0, "sgd seed 0", True)
        bar.update(5)
        bar.close()
        bars.finished(done)
    bars.close()
    text = out.getvalue() + err.getvalue()
    assert "run 2/2" in text and "sgd seed 0" in text  # the bars were drawn ...
    assert text.count("compare: 2 of 2 runs in ") == 1  # ... and the comparison ends in one line
    assert "[2/2] sgd seed 0: test acc 90.00%" in text
