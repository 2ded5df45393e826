"""Config values are checked against ranges at load, and names that become directories are
validated, each with one line naming the key (exit code 2): nothing is written, nothing crashes."""

from __future__ import annotations

from pathlib import Path

import pytest

from dqsgd.cli.commands import main
from dqsgd.core.config_file import ConfigError
from dqsgd.dq import config as dq_config
from dqsgd.dq.cli import main as dq_main

TRAIN = ["--quiet", "--set", 'train.dataset="synthetic"', "--set", 'train.model="mlp"', "--set", "train.workers=2",
         "--set", "train.steps=2", "--set", "train.batch_size=4"]


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "Traceback" not in err
    return err.splitlines()[-1]


@pytest.mark.parametrize("setting,msg", [
    ("train.threads=100000", "train: threads must be in 0..1024"),
    ("train.lr=1e308", "train: lr must be in (0, 1e+30]"),
    ("methods.qsgd.lr=1e308", "methods.qsgd.lr must be in (0, 1e+30]"),
    ("train.pad_to=100000", "train: pad_to must be in 0..1024"),
    ("train.workers=100000000", "train: workers must be in 1..4096"),
])
def test_train_values_out_of_range_are_refused_at_load(setting: str, msg: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["train", "--method", "qsgd", "--out", str(out), *TRAIN, "--set", setting]) == 2
    assert msg in _err(capsys)
    assert not out.exists()


@pytest.mark.parametrize("timeout", ["1e10", "1e308"])
def test_train_timeout_beyond_a_week_is_refused(timeout: str, tmp_path: Path, capsys) -> None:
    assert main(["train", "--method", "qsgd", "--out", str(tmp_path / "r"), "--transport", "torch", "--timeout", timeout,
                 *TRAIN]) == 2
    assert "--timeout must be in (0, 604800] seconds" in _err(capsys)


def test_a_config_nested_5000_deep_is_refused_naming_the_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "deep.toml"
    path.write_text("[train]\nx = " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(["train", "--method", "qsgd", "--config", str(path), "--out", str(tmp_path / "r")]) == 2
    assert f"{path}: arrays or tables nested too deep" in _err(capsys)
    assert main(["train", "--method", "qsgd", "--out", str(tmp_path / "r"), *TRAIN,
                 "--set", "train.x=" + "[" * 5000 + "]" * 5000]) == 2
    assert "nested too deep" in _err(capsys)


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", ".", "", ".hidden", "-x", "a\\b", "a b", "a\0b", "x" * 129])
def test_names_that_are_not_one_path_component_are_refused(name: str) -> None:
    from dqsgd.core.config_file import check_name

    with pytest.raises(ConfigError, match="cannot name a directory"):
        check_name("train.name", name)


@pytest.mark.parametrize("name", ["qsgd-4bit", "dqsgd_2p5", "asylpg-mu0.5", "table1-mnist", "x" * 128, "a+b=c@d"])
def test_ordinary_names_are_kept(name: str) -> None:
    from dqsgd.core.config_file import check_name

    assert check_name("train.name", name) == name


@pytest.mark.parametrize("argv,msg", [
    (["compare", "--set", 'train.name="../escaped"'], "train.name = '../escaped' cannot name a directory"),
    (["train", "--method", "qsgd", "--set", 'train.name="../escaped"'], "train.name = '../escaped' cannot name"),
    (["train", "--method", "../escaped"], "[methods.../escaped] label = '../escaped' cannot name a directory"),
])
def test_train_and_compare_refuse_path_names_at_load(argv: list[str], msg: str, tmp_path: Path, monkeypatch,
                                                     capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert main([*argv, *TRAIN]) == 2
    assert msg in _err(capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["runs"] and not any((tmp_path / "runs").iterdir())


def test_a_method_label_with_a_separator_is_refused_in_a_config_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[train]\ndataset = "synthetic"\n[methods."x/../../y"]\nmethod = "sgd"\n')
    assert main(["compare", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "[methods.x/../../y] label = 'x/../../y' cannot name a directory" in _err(capsys)
    assert not (tmp_path / "out").exists()


# --- dq ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting,msg", [
    ("experiment.name=\"../escaped\"", "experiment.name = '../escaped' cannot name a directory"),
    ("methods.asyfpg.lr=1e308", "lr must be in (0, 1000], got 1e+308"),
    ("run.delay_sigma=1e308", "delay_sigma must be in [0, 10]"),
    ("run.timeout_s=1e308", "timeout_s must be in (0, 604800] seconds"),
    ("run.timeout_s=1e10", "timeout_s must be in (0, 604800] seconds"),
    ("run.inner=1000000000000", "inner must be 0 or in workers..10000000"),
    ("run.max_updates=1000000000000", "inner/max_updates must be at most 1e+08 master updates"),
])
def test_dq_values_out_of_range_are_refused_at_load(setting: str, msg: str, tmp_path: Path, capsys) -> None:
    assert dq_main(["run", "--config", "dq-mnist-logreg", "--quick", "--out", str(tmp_path), "--set", setting]) == 2
    assert msg in _err(capsys)
    assert not any(tmp_path.iterdir())


def test_dq_method_label_with_a_separator_is_refused() -> None:
    raw, _ = dq_config.load_raw("dq-mnist-logreg")
    raw["methods"]["../x"] = {"algorithm": "asyfpg"}
    with pytest.raises(dq_config.DQConfigError, match=r"label = '\.\./x' cannot name a directory"):
        dq_config.build(raw)
