"""The ``root`` fixture: a finished fake comparison (sgd, qsgd-4bit, dqsgd × seeds 0, 1), see fake_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_runs import make_root


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path / "runs" / "fake-table1")
