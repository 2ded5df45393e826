"""Topology sharded on W = 3 gloo processes: bitwise the simulation, one width on every rank, a
dead rank stops everyone, and an announced oversized payload is refused before any allocation."""

import time
from pathlib import Path

import pytest
import torch

import _ranks
from dqsgd.cli.launch import spawn_local
from dqsgd.method.config import method_config
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.transport import SimTransport

pytestmark = pytest.mark.distributed

# 55,210 MLP parameters: 55210 = 3·18403 + 1, so the shards are uneven (18404, 18403, 18403); the
# bucket of 1000 does not divide a shard either, so every shard ends with a short bucket.
CFG = TrainConfig(name="sh", dataset="synthetic", model="mlp", workers=3, steps=8, batch_size=16, lr=0.1,
                  momentum=0.9, eval_every=100, topology="sharded")
ENTRIES = [
    MethodEntry("dqsgd-auto", method_config("dqsgd", coding="auto")),        # variable-size payloads
    MethodEntry("terngrad", method_config("terngrad")),                       # shared per-tensor scalers
    MethodEntry("qsgd-bucket", method_config("qsgd", bits=3, bucket=1000, kernel="fused")),
    MethodEntry("sgd-fp32", method_config("sgd")),
]
CASES = [("sharded", CFG, e, 0) for e in ENTRIES]


@pytest.mark.timeout(150)
def test_sharded_processes_match_simulation_bitwise() -> None:
    results = spawn_local(_ranks.train_cases, 3, (CASES,), timeout=30, threads=1, deadline=120)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for _, cfg, entry, seed in CASES:
        sim = _ranks.train(cfg, entry, seed, SimTransport(cfg.workers, "sharded"))
        if entry.label.startswith("dqsgd"):
            assert len(set(sim["bits"])) > 1, "the dynamic policy should change the width in this run"
        runs = [r.value[f"sharded/{entry.label}"] for r in results]
        assert all(run["bits"] == runs[0]["bits"] for run in runs), f"{entry.label}: ranks disagree on a width"
        for r, run in zip(results, runs):
            where = f"{entry.label} rank {r.rank}"
            for key in ("bits", "next_bits", "up", "down", "wire", "coded"):  # coded: every step (coded_every = 1)
                assert run[key] == sim[key], (where, key)
            assert torch.equal(run["params"], sim["params"]), where
        assert [step for step, _ in sim["coded"]] == list(range(cfg.steps))
        if entry.label == "dqsgd-auto":
            sizes = {tuple(u) for u in sim["up"]}
            assert len(sizes) > 1, "auto-coded payloads should vary in size"
            assert [c for _, c in sim["coded"]] == sim["up"]  # AUTO of an AUTO payload: the same length


@pytest.mark.timeout(90)
def test_dead_rank_stops_every_sharded_rank(tmp_path: Path) -> None:
    timeout = 15.0
    stamp = tmp_path / "killed_at"
    qsgd = MethodEntry("qsgd", method_config("qsgd"))
    results = spawn_local(_ranks.train_with_fault, 3, ("sharded", CFG, qsgd, "kill", 1, 3, str(stamp)),
                          timeout=timeout, deadline=80)
    stopped = time.time()
    assert results[1].exitcode == -9
    for r in (results[0], results[2]):
        assert r.exitcode == 1, r.describe()
        assert r.error is not None and r.error.startswith(f"TransportError: rank {r.rank}:"), r.error
        assert "failed after 3 completed steps" in r.error
    assert stopped - float(stamp.read_text()) < timeout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("topology", ["ps", "allgather", "sharded"])
def test_announced_400MB_payload_is_refused_before_allocating(topology: str) -> None:
    results = spawn_local(_ranks.oversized_payload, 3, (topology,), timeout=30, deadline=60)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for r in results:
        v = r.value
        assert v["error"] is not None, f"rank {r.rank} accepted the announced size"
        assert "rank 1 announced a payload of 400000000 bytes" in v["error"], v["error"]
        assert f"at most {v['cap']} bytes" in v["error"]
        assert v["grew_kib"] < 50_000, f"rank {r.rank}: peak memory grew by {v['grew_kib']} KiB"


@pytest.mark.timeout(90)
def test_malformed_shard_payload_stops_every_rank_naming_the_worker() -> None:
    """Rank 1 sends zero bytes from its 4th shard payload on: the server of that shard refuses it, the
    others stop at once and name the worker from the error board (not at the timeout)."""
    start = time.time()
    qsgd = MethodEntry("qsgd", method_config("qsgd"))
    results = spawn_local(_ranks.train_with_fault, 3, ("sharded", CFG, qsgd, "garbage", 1, 3, ""), timeout=15.0,
                          deadline=80)
    for r in results:
        assert r.exitcode == 1, r.describe()
        assert r.error is not None and "worker 1: not a dqsgd payload" in r.error, r.error
    assert results[0].error.startswith("PayloadError: rank 0:")  # type: ignore[union-attr]  # serves shard 0
    assert time.time() - start < 60
