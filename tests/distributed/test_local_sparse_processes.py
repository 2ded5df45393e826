"""Sparse pseudo-gradients on real processes: top-k (error-fed, fixed and budgeted) and random-k Local SGD on
2 gloo ranks bitwise equal to the simulation (widths, densities, bytes, model), and LocalSGDOptimizer's exact
resume from its state dict (the error-feedback residual and the budget's state in it)."""

import pytest
import torch

import _ranks
import _ranks_local
from dqsgd.cli.launch import spawn_local
from dqsgd.method.config import method_config
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.transport import SimTransport

pytestmark = pytest.mark.distributed

CFG = TrainConfig(name="local-sparse", dataset="synthetic", model="mlp", workers=2, steps=24, batch_size=16, lr=0.1,
                  momentum=0.9, eval_every=100, coded_every=2, topology="sharded", local_steps=6, downlink_bits=8)
NESTEROV = TrainConfig(**{**CFG.__dict__, "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9,
                          "downlink_bits": 32})
CASES = [("allgather", TrainConfig(**{**CFG.__dict__, "topology": "allgather"}),
          MethodEntry("topk-budget", method_config("topk-budget")), 0),
         ("sharded", CFG, MethodEntry("topk", method_config("topk")), 0),
         ("sharded", NESTEROV, MethodEntry("topk-budget", method_config("topk-budget")), 1),
         ("ps", TrainConfig(**{**CFG.__dict__, "topology": "ps"}), MethodEntry("randk", method_config("randk")), 0)]


@pytest.mark.timeout(300)
def test_sparse_local_sgd_on_processes_matches_simulation_bitwise() -> None:
    results = spawn_local(_ranks.train_cases, 2, (CASES,), timeout=60, threads=1, deadline=240)
    assert all(r.ok for r in results), [r.describe() for r in results]
    assert torch.get_num_threads() == 1
    for topology, cfg, entry, seed in CASES:
        sim = _ranks.train(cfg, entry, seed, SimTransport(cfg.workers, topology))
        assert [n for n, up in enumerate(sim["up"]) if up] == [5, 11, 17, 23]
        if entry.label == "topk-budget":
            assert len({sim["bits"][n] for n in (5, 11, 17, 23)}) > 1, "the budget should change the width"
        for r in results:
            run = r.value[f"{topology}/{entry.label}"]
            where = f"{topology}/{entry.label} rank {r.rank}"
            assert run["bits"] == sim["bits"] and run["next_bits"] == sim["next_bits"], where
            assert torch.equal(run["params"], sim["params"]), where
            if topology != "ps" or r.rank == 0:  # a ps rank other than the server sees no sizes
                assert (run["up"], run["down"], run["wire"], run["coded"]) == \
                    (sim["up"], sim["down"], sim["wire"], sim["coded"]), where


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method,options", [("topk", {}), ("topk-budget", {"target_bits": 3.0}),
                                            ("randk", {"topk_ratio": 0.1, "error_feedback": True}),
                                            ("topk", {"fragments": 2, "overlap": 1}),  # streaming: per fragment
                                            # a dense method that draws from the generator, with an exchange in
                                            # flight at the cut: the state waits for it before saving the stream
                                            ("qsgd-4bit", {"kernel": "torch", "fragments": 2, "overlap": 1})])
def test_local_sgd_optimizer_resumes_exactly(method: str, options: dict) -> None:
    results = spawn_local(_ranks_local.resume, 2, (4, 16, 10, method, options), timeout=30, threads=1, deadline=100)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for v in (r.value for r in results):
        assert torch.equal(v["full"], v["resumed"]) and v["link"][0] == v["link"][1] > 0
        assert v["bits"][0] == v["bits"][1]
        if "fragments" not in options:  # (the fragments keep their residuals in their own states)
            assert v["residual"] is not None and float(v["residual"].abs().max()) > 0
    a, b = (r.value for r in results)
    assert torch.equal(a["full"], b["full"])
