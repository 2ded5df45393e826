"""The report says where and when its runs ran: machine, date, commit."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dqsgd.experiments.report import build_report
from dqsgd.train.rundir import environment, source_commit


def test_report_names_machine_date_and_commit(root: Path) -> None:
    env = {"cpu": "Test CPU 9000", "cpu_count": 2, "gpu": "", "date": "2026-11-20T10:00:00Z", "commit": "abc123"}
    for cfg in root.glob("*/seed*/config.json"):
        facts = json.loads(cfg.read_text())
        cfg.write_text(json.dumps({**facts, "environment": env}))
    text = build_report(root).read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("**Where and when.**"))
    assert "Test CPU 9000, 2 cores, GPU: none" in line and "2026-11-20" in line and "abc123" in line


def test_older_runs_fall_back_to_the_file_date(root: Path) -> None:
    text = build_report(root).read_text()  # the fake runs record no environment
    line = next(ln for ln in text.splitlines() if ln.startswith("**Where and when.**"))
    assert "CPU not recorded" in line and "commit: not recorded" in line
    assert re.search(r"Date \(UTC\): \d{4}-\d\d-\d\d", line)


def test_environment_records_gpu_date_and_commit() -> None:
    env = environment()
    assert set(env) >= {"cpu", "cpu_count", "gpu", "date", "commit"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", env["date"])
    assert env["commit"] == source_commit()  # this checkout's commit ("" outside git)
