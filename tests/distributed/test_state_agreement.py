"""Issue 40, causes 1 and 5 across processes (gloo on 127.0.0.1, a free port each, explicit timeouts): the
rank agreement covers progress, initial parameters and checkpoint_every, names exactly the fields that
differ, catches FSDP models of other shapes before FSDP's own all-gather, and `--timeout` reaches the
backup workers' transport."""

from __future__ import annotations

from pathlib import Path

import _ranks_state
import pytest

from dqsgd.cli.launch import spawn_local
from dqsgd.method.config import method_config
from dqsgd.train.config import ExperimentConfig, MethodEntry, TrainConfig

pytestmark = pytest.mark.distributed
TIMEOUT = 30.0


def _errors(fn, *args) -> list[str]:
    results = spawn_local(fn, 2, args, timeout=TIMEOUT, threads=1, deadline=120)
    assert all(r.ok for r in results), [r.describe() for r in results]
    return [r.value["error"] for r in results]


@pytest.mark.timeout(150)
def test_e2_local_sgd_ranks_resumed_from_different_rounds_are_refused() -> None:
    for err in _errors(_ranks_state.local_rounds):
        assert err is not None and "progress.rounds_done (rank(s) [1] differ from rank 0" in err, err
        assert "progress.steps (rank(s) [1]" in err, err


@pytest.mark.timeout(150)
@pytest.mark.parametrize("method", ["qsgd-4bit", "sgd"])
def test_e3_local_sgd_ranks_with_different_initial_parameters_are_refused(method: str) -> None:
    for err in _errors(_ranks_state.local_init, method):
        assert err is not None and "params.start (rank(s) [1] differ from rank 0" in err, err


@pytest.mark.timeout(150)
def test_e7_ranks_with_different_checkpoint_every_refuse_to_start(tmp_path: Path) -> None:
    for err in _errors(_ranks_state.checkpoint_every, str(tmp_path / "run")):
        assert err is not None and "train.checkpoint_every (rank(s) [1] differ from rank 0" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step


@pytest.mark.timeout(150)
def test_l1_a_disagreement_names_exactly_the_differing_field() -> None:
    results = spawn_local(_ranks_state.sweep_fields, 2, (), timeout=TIMEOUT, threads=1, deadline=120)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for r in results:
        for key, err in r.value["named"].items():
            assert err is not None and f"{key} (rank(s) [1]" in err, (key, err)
            innocent = [k for k in r.value["named"] if k != key and f"{k} (rank(s)" in err]
            assert innocent == [], (key, innocent)


@pytest.mark.timeout(150)
def test_l12_fsdp_models_of_other_shapes_are_refused_by_compress() -> None:
    for err in _errors(_ranks_state.fsdp_shapes):
        assert err is not None and "dqsgd.fsdp.compress" in err and "fsdp.unit0.shapes (rank(s) [1]" in err, err


@pytest.mark.timeout(150)
def test_m6_backup_workers_transport_waits_the_given_timeout() -> None:
    cfg = TrainConfig(name="b", dataset="synthetic", model="mlp", workers=2, steps=2, batch_size=8, topology="ps",
                      backup_workers=1, coded_every=0)
    exp = ExperimentConfig(cfg, (MethodEntry("qsgd", method_config("qsgd")),))
    results = spawn_local(_ranks_state.backup_timeout, 2, (exp,), timeout=TIMEOUT, threads=1, deadline=120)
    assert all(r.ok for r in results), [r.describe() for r in results]
    assert [r.value for r in results] == [{"wait_s": 5.0, "backup": 1}] * 2


@pytest.mark.timeout(150)
def test_l10_malformed_local_sgd_states_are_refused_before_anything_is_loaded() -> None:
    results = spawn_local(_ranks_state.local_malformed, 2, (), timeout=TIMEOUT, threads=1, deadline=120)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for r in results:
        errors = r.value["errors"]
        assert all(e is not None and "malformed state" in e for e in errors), errors
        assert "'outer'" in errors[0] and "'steps'" in errors[1] and "'params'" in errors[2], errors
        assert r.value["unchanged"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fragments", [1, 2])
def test_l10_forged_downlink_residuals_are_refused_before_anything_is_loaded(fragments: int) -> None:
    results = spawn_local(_ranks_state.local_malformed_fed, 2, (fragments,), timeout=TIMEOUT, threads=1, deadline=120)
    assert all(r.ok for r in results), [r.describe() for r in results]
    for r in results:
        errors, name = r.value["errors"], "'down_residuals'" if fragments == 1 else "'down'"
        assert all(e is not None and "malformed state" in e and name in e for e in errors), errors
        assert "of " in errors[0] and "elements" in errors[0], errors[0]
        assert "NaN or Inf" in errors[1] and "not a shard index" in errors[2] and "got list" in errors[3], errors
        assert r.value["unchanged"] and r.value["nonzero"]


@pytest.mark.timeout(150)
def test_hook_ranks_resumed_from_different_steps_are_refused() -> None:
    for err in _errors(_ranks_state.hook_progress):
        assert err is not None and "progress.iter (rank(s) [1] differ from rank 0" in err, err
