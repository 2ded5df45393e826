"""A dead worker or a malformed payload stops every rank with a clear error, well within the timeout."""

import time
from pathlib import Path

import pytest

import _ranks
from dqsgd.cli.launch import spawn_local
from dqsgd.method.config import method_config
from dqsgd.train.config import MethodEntry, TrainConfig

pytestmark = pytest.mark.distributed

TIMEOUT = 15.0  # seconds per collective
CFG = TrainConfig(name="fail", dataset="synthetic", model="mlp", workers=3, steps=8, batch_size=16, lr=0.1,
                  eval_every=100)
QSGD = MethodEntry("qsgd", method_config("qsgd"))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("topology", ["ps", "allgather"])  # sharded: test_sharded.py
def test_dead_worker_stops_every_rank(topology: str, tmp_path: Path) -> None:
    stamp = tmp_path / "killed_at"
    args = (topology, CFG, QSGD, "kill", 2, 3, str(stamp))
    results = spawn_local(_ranks.train_with_fault, 3, args, timeout=TIMEOUT, deadline=80)
    stopped = time.time()
    assert results[2].exitcode == -9 and "SIGKILL" in results[2].describe()
    for r in results[:2]:
        assert r.exitcode == 1, r.describe()
        assert r.error is not None and r.error.startswith(f"TransportError: rank {r.rank}:"), r.error
        assert "failed after 3 completed steps" in r.error
        assert "crashed, was killed or did not answer" in r.error
    # Every survivor was gone well before the collective timeout (the peer's closed socket is seen at once).
    assert stopped - float(stamp.read_text()) < TIMEOUT


@pytest.mark.timeout(90)
def test_malformed_payload_names_the_worker_on_every_rank() -> None:
    """PS topology: only the server decodes, so it must tell the others (all-gather: every rank decodes)."""
    start = time.time()
    results = spawn_local(_ranks.train_with_fault, 3, ("ps", CFG, QSGD, "garbage", 1, 3, ""), timeout=TIMEOUT,
                          deadline=80)
    for r in results:
        assert r.exitcode == 1, r.describe()
        assert r.error is not None and r.error.startswith(f"PayloadError: rank {r.rank}:"), r.error
        assert "worker 1: not a dqsgd payload" in r.error
        # told by the server in the downlink message, not by a timeout
        assert f"rank {r.rank}: step 3: the server (rank 0) refused a payload: worker 1: " in r.error
    assert time.time() - start < 60
