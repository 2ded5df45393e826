"""Shipped configs are valid; the CLI refuses bad input with a clear message and a non-zero exit."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dqsgd.cli.commands import main
from dqsgd.data import DATASETS
from dqsgd.method.pipeline import Method
from dqsgd.models import MODELS
from dqsgd.train.config import ConfigError, apply_overrides, build_experiment, load_experiment, shipped_configs

SHIPPED = sorted(shipped_configs())


def test_the_expected_configs_ship() -> None:
    for name in ["table1-mnist", "table1-fashion", "table1-bbcnews", "table1-cifar10", "table1-cifar100", "table1-agnews"]:
        assert name in SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_is_valid(name: str) -> None:
    path = shipped_configs()[name]
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and ("dqsgd" in first or "python -m" in first), "first line must give the command"
    if name.startswith("dq-") or name.startswith("theory"):
        pytest.skip("Double Quantization / theory configs are validated by their own tests")
    exp = load_experiment(name)
    assert exp.train.dataset in DATASETS and exp.train.model in MODELS and exp.methods
    for e in exp.methods:  # the budgets are feasible and every method builds for a model of this size
        Method(e.config, 61706, exp.train.steps, [61706 - 706, 706])


@pytest.mark.parametrize("raw,msg", [
    ({"train": {"stepz": 3}}, "unknown train key"),
    ({"train": {"steps": "many"}}, "train.steps must be int"),
    ({"train": {"workers": 0}}, "workers must be in 1..4096"),
    ({"trian": {}}, "unknown section"),
    ({"methods": {"qsgd": {"bits": 1}}}, "bits must be in"),
    ({"methods": {"foo": {}}}, "unknown method"),
    ({"methods": {"dqsgd": {"alpha": 2.0}}}, "alpha"),
    ({"methods": {"qsgd": {"lr": "fast"}}}, "lr must be float"),
])
def test_malformed_configs_refused(raw, msg) -> None:
    with pytest.raises(ConfigError, match=msg):
        build_experiment(raw)


def test_overrides() -> None:
    raw = apply_overrides({"train": {"steps": 3}}, ["train.steps=7", 'train.dataset=synthetic', "methods.q.bits=3",
                                                    "methods.q.method=\"qsgd\""])
    exp = build_experiment(raw)
    assert exp.train.steps == 7 and exp.train.dataset == "synthetic" and exp.methods[0].config.bits == 3
    for bad in ["train.steps", "nosection.x=1", "methods.q=3"]:
        with pytest.raises(ConfigError):
            apply_overrides({}, [bad])


@pytest.mark.parametrize("argv,msg", [
    (["train", "--method", "nosuch"], "unknown method 'nosuch'"),
    (["compare", "--set", "train.stepz=3"], "unknown train key"),
    (["compare", "--set", "train.steps=-1"], "steps must be in 1..10^9"),
    (["compare", "--config", "no-such-config"], "no config 'no-such-config'"),
    (["train", "--method", "qsgd", "--set", "methods.qsgd.bits=40"], "bits must be in"),
    (["train", "--method", "sgd", "--set", "train.dataset=cifar10", "--set", "train.data_root=/nonexistent"],
     "cifar-10-batches-py"),
    (["report", "/nonexistent/run"], "no runs"),
])
def test_cli_errors_are_clear_and_nonzero(argv, msg, capsys, tmp_path) -> None:
    assert main(argv + (["--out", str(tmp_path)] if argv[0] != "report" else [])) == 2
    assert msg in capsys.readouterr().err


def test_cli_lists_methods_and_configs(capsys) -> None:
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "dqsgd" in out and "terngrad" in out and "qsgd-<B>bit" in out
    assert main(["configs"]) == 0
    assert "table1-mnist" in capsys.readouterr().out


def test_cli_compare_end_to_end_and_report_rebuild(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dqsgd", "compare", "--config", "table1-mnist", "--quiet", "--out", str(out),
           "--set", "train.dataset=synthetic", "--set", "train.model=mlp", "--set", "train.steps=8",
           "--set", "train.eval_every=4", "--set", "train.workers=4", "--set", "train.batch_size=8",
           "--methods", "sgd,qsgd-4bit,dqsgd"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "qsgd-4bit" in res.stdout and "uplink ratio" in res.stdout and "total ratio" in res.stdout
    for f in ["summary.csv", "summary.json", "report.md", "experiment.toml"]:
        assert (out / f).exists()
    before = (out / "summary.csv").read_text()
    for f in ["summary.csv", "summary.json", "report.md"]:
        (out / f).unlink()
    res = subprocess.run([sys.executable, "-m", "dqsgd", "report", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (out / "summary.csv").read_text() == before and (out / "report.md").exists()


def test_compare_resume_keeps_finished_runs_and_runs_the_missing_ones(tmp_path: Path) -> None:
    from dqsgd.cli.commands import main

    out = tmp_path / "run"
    base = ["compare", "--config", "table1-mnist", "--quiet", "--out", str(out), "--set", "train.dataset=synthetic",
            "--set", "train.model=mlp", "--set", "train.steps=6", "--set", "train.eval_every=3",
            "--set", "train.workers=2", "--set", "train.batch_size=8"]
    assert main(base + ["--methods", "sgd,qsgd-4bit"]) == 0
    done = out / "sgd" / "seed0" / "metrics.jsonl"
    stamp, text = done.stat().st_mtime_ns, done.read_text()
    (out / "qsgd-4bit" / "seed0" / "summary.json").unlink()  # as if killed before its end
    assert main(base + ["--methods", "sgd,qsgd-4bit,dqsgd", "--resume"]) == 0
    assert done.stat().st_mtime_ns == stamp and done.read_text() == text  # finished: not run again
    for label in ("qsgd-4bit", "dqsgd"):  # unfinished and missing: run (from scratch: no checkpoints)
        rows = [json.loads(line) for line in (out / label / "seed0" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(6))
        assert json.loads((out / label / "seed0" / "summary.json").read_text())["steps"] == 6
