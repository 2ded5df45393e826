"""Same seed ⇒ same bits and bitwise the same model: W = 4 gloo processes vs the in-process simulation.

Why this can be bitwise: a worker's minibatch and its quantization generator are pure functions of
(seed, worker, step); the model starts from the same seeded init; the server (or, all-gather, every
rank) decodes the very same bytes in worker order and sums them in that order; every process then
applies the same decoded update. The only requirement is the same torch intra-op thread count in the
simulation and in the ranks (here 1, see tests/conftest.py): CPU GEMM and reductions split their sums
by thread count, and 1 vs 2 threads gives ~1e-9 differences in the MLP's gradients.
"""

import pytest
import torch

import _ranks
from dqsgd.cli.launch import spawn_local
from dqsgd.method.config import method_config
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.transport import SimTransport

pytestmark = pytest.mark.distributed

# coded_every = 2: the entropy-coded uplink sizes of steps 0, 2, ..., 14, all-gathered across the ranks.
CFG = TrainConfig(name="eq", dataset="synthetic", model="mlp", workers=4, steps=15, batch_size=16, lr=0.1,
                  momentum=0.9, eval_every=100, coded_every=2)
ENTRIES = [MethodEntry("dqsgd", method_config("dqsgd")), MethodEntry("terngrad", method_config("terngrad"))]
# sharded: the MLP's 55,210 parameters are not divisible by W = 4; signSGD's majority vote runs per shard.
SHARDED = [MethodEntry("dqsgd", method_config("dqsgd")), MethodEntry("signsgd", method_config("signsgd"))]
CASES = [(topo, CFG, e, 0) for topo in ("ps", "allgather") for e in ENTRIES] + [
    ("sharded", CFG, e, 0) for e in SHARDED]


@pytest.fixture(scope="module")
def results() -> list:
    results = spawn_local(_ranks.train_cases, 4, (CASES,), timeout=30, threads=1, deadline=100)
    assert all(r.ok for r in results), [r.describe() for r in results]
    return results


@pytest.mark.timeout(120)
def test_processes_match_simulation_bitwise(results: list) -> None:
    assert torch.get_num_threads() == 1  # the ranks run 1 thread each; see the module docstring
    for topology, cfg, entry, seed in CASES:
        sim = _ranks.train(cfg, entry, seed, SimTransport(cfg.workers, "sharded" if topology == "sharded" else "ps"))
        if entry.label == "dqsgd":
            assert len(set(sim["bits"])) > 1, "the dynamic policy should change the width in this run"
        assert [step for step, _ in sim["coded"]] == list(range(0, cfg.steps, 2))
        for r in results:
            run = r.value[f"{topology}/{entry.label}"]
            where = f"{topology}/{entry.label} rank {r.rank}"
            assert run["bits"] == sim["bits"], where
            assert run["next_bits"] == sim["next_bits"], where
            assert torch.equal(run["params"], sim["params"]), where
            # every rank logs the mean loss of all W workers (an all-reduce: the sum order may differ)
            assert run["loss"] == pytest.approx(sim["loss"], rel=1e-12, abs=0), where
            if r.rank == 0 or topology != "ps":  # the aggregating ranks measured the same bytes
                assert run["up"] == sim["up"], where
                assert run["coded"] == sim["coded"], where  # and the same entropy-coded sizes
            if topology == "sharded":  # every rank holds the whole size matrix: same per-rank bytes
                assert (run["down"], run["wire"]) == (sim["down"], sim["wire"]), where


def test_peer_ranks_that_disagree_all_stop(results: list) -> None:
    """All-gather topology: one rank with another B_{n+1} makes every rank raise RankDisagreement."""
    for r in results:
        msg = r.value["disagreement"]
        assert msg.startswith(f"rank {r.rank}: after step 0 the ranks disagree on (B_n+1"), msg
