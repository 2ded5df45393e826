"""Local SGD on real processes: W = 4 (and 2, error-fed) gloo ranks, H = 8, topology sharded, bitwise equal to
the simulation.

The inner steps of a worker are a pure function of its data and the synchronized model, so a process that
runs one worker computes exactly what the simulation computes for it; the pseudo-gradients then go
through the same step object as gradients do (see test_equivalence.py for why that exchange is bitwise).
"""

import pytest
import torch

import _ranks
from dqsgd.cli.launch import spawn_local
from dqsgd.method.config import method_config
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.transport import SimTransport

pytestmark = pytest.mark.distributed

CFG = TrainConfig(name="local-eq", dataset="synthetic", model="mlp", workers=4, steps=40, batch_size=16, lr=0.1,
                  momentum=0.9, eval_every=100, coded_every=2, topology="sharded", local_steps=8, downlink_bits=8)
# budgeted DQSGD also with DiLoCo's outer Nesterov step, AdamW inside the rounds, and the both-leg split of the
# budget (downlink_bits = "auto": each round's uplink and downlink widths chosen together)
DILOCO = TrainConfig(**{**CFG.__dict__, "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9,
                        "inner_optimizer": "adamw", "lr": 0.003, "downlink_bits": "auto"})
CASES = [("sharded", CFG, MethodEntry("qsgd-4bit", method_config("qsgd-4bit")), 0),
         ("sharded", CFG, MethodEntry("dqsgd", method_config("dqsgd")), 0),
         ("sharded", DILOCO, MethodEntry("dqsgd-coded", method_config("dqsgd-coded")), 1),
         ("sharded", CFG, MethodEntry("qsgd-2bit-ef", method_config("qsgd-2bit", error_feedback=True)), 0)]
# error-fed pseudo-gradients also on two processes (each worker's residual carried across the rounds)
CASES_2 = [("sharded", TrainConfig(**{**CFG.__dict__, "workers": 2}),
            MethodEntry("qsgd-2bit-ef", method_config("qsgd-2bit", error_feedback=True)), 0)]


@pytest.fixture(scope="module")
def results() -> list:
    results = spawn_local(_ranks.train_cases, 4, (CASES,), timeout=60, threads=1, deadline=280)
    assert all(r.ok for r in results), [r.describe() for r in results]
    return results


@pytest.mark.timeout(360)
def test_local_sgd_on_processes_matches_simulation_bitwise(results: list) -> None:
    check_against_simulation(CASES, results)


@pytest.mark.timeout(180)
def test_error_fed_local_sgd_on_two_processes_matches_simulation_bitwise() -> None:
    results = spawn_local(_ranks.train_cases, 2, (CASES_2,), timeout=30, threads=1, deadline=120)
    assert all(r.ok for r in results), [r.describe() for r in results]
    check_against_simulation(CASES_2, results)


def check_against_simulation(cases: list, results: list) -> None:
    assert torch.get_num_threads() == 1
    for topology, cfg, entry, seed in cases:
        sim = _ranks.train(cfg, entry, seed, SimTransport(cfg.workers, topology))
        exchanged = [n for n, up in enumerate(sim["up"]) if up]
        assert exchanged == [7, 15, 23, 31, 39]
        if entry.label == "dqsgd":  # (the coded budget of the AdamW run stays at its smallest width)
            assert len({sim["bits"][n] for n in exchanged}) > 1, "the budgeted policy should change the width"
        for r in results:
            run = r.value[f"{topology}/{entry.label}"]
            where = f"{entry.label} rank {r.rank}"
            assert run["bits"] == sim["bits"] and run["next_bits"] == sim["next_bits"], where
            assert torch.equal(run["params"], sim["params"]), where
            assert (run["up"], run["down"], run["wire"], run["coded"]) == \
                (sim["up"], sim["down"], sim["wire"], sim["coded"]), where
            assert run["loss"] == pytest.approx(sim["loss"], rel=1e-12, abs=0), where
