"""The Local SGD rows of benchmarks/network/bench_network.py (local_rows.py) on two gloo ranks, no shaping."""

from pathlib import Path

import pytest
import torch

import _bench_local_ranks
from dqsgd.cli.launch import spawn_local

pytestmark = pytest.mark.distributed

FOLDER = Path(__file__).resolve().parents[2] / "benchmarks" / "network"


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_local_sgd_rows_average_every_h_steps() -> None:
    """H = 2, ending on an exchange: after it both ranks hold the same model (PyTorch's averager, dqsgd's
    fp32 and QSGD rows, and a config's DiLoCo row with the error-fed downlink, unfragmented and streaming,
    alike), and quantizing Δ (and the outer step, and streaming) changed it."""
    results = spawn_local(_bench_local_ranks.local_rows, 2, (str(FOLDER),), timeout=30, deadline=110)
    assert all(r.ok for r in results), [r.describe() for r in results]
    mine, theirs = results[0].value, results[1].value
    for method, params in mine.items():
        assert torch.equal(params, theirs[method]), method
    assert not torch.equal(mine["local-h2"], mine["local-h2-qsgd-4bit"])
    diloco, streaming = (mine[m] for m in _bench_local_ranks.CONFIG_ROWS)
    assert not torch.equal(diloco, mine["local-h2"]) and not torch.equal(diloco, streaming)
