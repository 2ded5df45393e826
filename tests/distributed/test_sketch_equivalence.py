"""Sketched SGD, same seed ⇒ the same bytes and bitwise the same model: W = 4 gloo processes vs the
in-process simulation, on every topology (see test_equivalence.py for why this can be bitwise)."""

import pytest
import torch

import _ranks
from dqsgd.cli.launch import spawn_local
from dqsgd.method.config import method_config
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.transport import SimTransport

pytestmark = pytest.mark.distributed

CFG = TrainConfig(name="eq-sketch", dataset="synthetic", model="mlp", workers=4, steps=8, batch_size=16, lr=0.1,
                  momentum=0.9, eval_every=100, coded_every=2)
ENTRY = MethodEntry("sketched-sgd", method_config("sketched-sgd", topk_ratio=0.01), momentum=0.0)
CASES = [(topo, CFG, ENTRY, 0) for topo in ("allgather", "ps", "sharded")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sketched_sgd_processes_match_simulation_bitwise() -> None:
    assert torch.get_num_threads() == 1  # the ranks run 1 thread each
    results = spawn_local(_ranks.train_cases, 4, (CASES,), timeout=60, threads=1, deadline=450)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for topology, cfg, entry, seed in CASES:
        sim = _ranks.train(cfg, entry, seed, SimTransport(cfg.workers, topology))
        assert len({tuple(u) for u in sim["up"]}) == 1 and sim["up"][0][0] > 0  # fixed sizes, every step
        for r in results:
            run = r.value[f"{topology}/{entry.label}"]
            where = f"{topology} rank {r.rank}"
            assert torch.equal(run["params"], sim["params"]), where
            if r.rank == 0 or topology != "ps":
                assert (run["up"], run["down"], run["coded"]) == (sim["up"], sim["down"], sim["coded"]), where
            if topology == "sharded":
                assert run["wire"] == sim["wire"], where
    for r in results:  # one rank that claims another width makes every rank stop (the candidates' broadcast)
        assert r.value["disagreement"].startswith(f"rank {r.rank}: after step 0 the ranks disagree"), r.value
