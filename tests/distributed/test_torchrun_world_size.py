"""Under torchrun, train.workers is WORLD_SIZE unless the command line sets it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SMALL = ["--config", "table1-mnist", "--method", "dqsgd", "--set", 'train.dataset="synthetic"',
         "--set", 'train.model="mlp"', "--set", "train.steps=3", "--quiet"]


@pytest.mark.timeout(150)
def test_torchrun_takes_workers_from_world_size(tmp_path: Path) -> None:
    """table1-mnist says workers = 8; two torchrun processes train with W = 2 and rank 0 says why."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dqsgd",
           "train", "--transport", "torch", "--topology", "allgather", "--timeout", "30", *SMALL,
           "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=130, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("train.workers = 2 from torchrun's WORLD_SIZE (the config says 8)") == 1  # rank 0 only
    assert json.loads((tmp_path / "summary.json").read_text())["workers"] == 2
