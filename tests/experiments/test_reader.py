"""The one metrics reader: every number `report` and `compare --resume` read is checked (present,
finite, in range); a bad one stops with exit code 2 and one line naming file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dqsgd.cli.commands import main

BASE = ["--quiet", "--set", 'train.dataset="synthetic"', "--set", 'train.model="mlp"', "--set", "train.workers=2",
        "--set", "train.batch_size=8", "--set", "train.eval_every=2", "--set", "train.threads=1",
        "--set", "train.steps=4"]


@pytest.fixture(scope="module")
def finished_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cmp") / "cmp"
    cfg = root.parent / "exp.toml"
    cfg.write_text('[train]\nname = "c"\n[methods.sgd]\n[methods.qsgd]\nbits = 4\n')
    assert main(["compare", "--config", str(cfg), "--out", str(root), *BASE]) == 0
    return root


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("edit,field,why", [
    (lambda r: r.pop("up_bytes"), "up_bytes", "is missing"),
    (lambda r: r.update(up_bytes=float("inf")), "up_bytes", "must be an integer"),
    (lambda r: r.update(up_bytes=1e308), "up_bytes", "must be an integer"),
    (lambda r: r.update(up_bytes=10**300), "up_bytes", "must be in"),
    (lambda r: r.update(test_acc=float("inf")), "test_acc", "must be finite"),
    (lambda r: r.update(test_acc=1.5), "test_acc", "must be in [0, 1]"),
    (lambda r: r.update(bits=float("nan")), "bits", "must be finite"),
    (lambda r: r.update(compute_s="fast"), "compute_s", "must be a number"),
])
def test_report_refuses_a_bad_number_naming_file_line_and_field(edit, field: str, why: str, finished_root: Path,
                                                                 tmp_path: Path, capsys) -> None:
    root = _copy(finished_root, tmp_path / "r")
    path = root / "qsgd" / "seed0" / "metrics.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    edit(recs[1])  # line 2 (the record of step 1 carries test_acc: eval_every = 2)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))  # json writes inf as Infinity
    assert main(["report", str(root)]) == 2
    line = _err(capsys)
    assert line.startswith(f"dqsgd: error: {path}:2: field {field!r} {why}"), line


def test_report_lists_missing_runs(finished_root: Path, tmp_path: Path, capsys) -> None:
    import shutil

    root = _copy(finished_root, tmp_path / "r")
    shutil.rmtree(root / "sgd")  # the baseline's files are gone
    assert main(["report", str(root)]) == 0
    err = capsys.readouterr().err
    assert "run(s) sgd/seed0 of experiment.toml missing" in err
    assert json.loads((root / "summary.json").read_text())["missing"] == ["sgd/seed0"]


def test_report_names_a_damaged_config_json(finished_root: Path, tmp_path: Path, capsys) -> None:
    root = _copy(finished_root, tmp_path / "r")
    cfg = root / "qsgd" / "seed0" / "config.json"
    cfg.write_text(cfg.read_text()[:40] + "," + cfg.read_text()[40:])
    assert main(["report", str(root)]) == 2
    line = _err(capsys)
    assert f"{cfg}: unreadable" in line, line


def test_report_of_an_intact_comparison_still_works(finished_root: Path, tmp_path: Path) -> None:
    root = _copy(finished_root, tmp_path / "r")
    assert main(["report", str(root)]) == 0
    assert [r["method"] for r in json.loads((root / "summary.json").read_text())["methods"]] == ["sgd", "qsgd"]
