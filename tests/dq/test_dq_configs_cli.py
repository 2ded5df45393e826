"""Shipped dq-* configs are valid and say how to run them; bad configs are refused with the key
named; ``python -m dqsgd.dq run --quick`` writes the JSONL, the figures and the report."""

import json

import pytest

from dqsgd.dq.algorithms import ALGORITHMS
from dqsgd.dq.cli import DEFAULT_CONFIGS, main
from dqsgd.dq.config import DQConfigError, build, load, shipped

SHIPPED = sorted(shipped())


def test_the_default_configs_ship() -> None:
    assert set(DEFAULT_CONFIGS) <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_is_valid(name: str) -> None:
    first = shipped()[name].read_text().splitlines()[0]
    assert first.startswith(f"# dqsgd dq run --config {name} ")
    for quick in (False, True):
        exp = load(name, is_quick=quick)
        labels = [r.label for r in exp.runs()]
        assert len(labels) == len(set(labels)) and exp.spec.name == name
        assert {m.cfg.algorithm for m in exp.methods} == set(ALGORITHMS)  # the whole table, every time
    assert load(name, ["run.lr=0.01", "methods.asylpg.mu=1.0"]).methods[0].cfg.mu == 1.0


@pytest.mark.parametrize("raw,msg", [
    ({"experiment": {"target": 0.1}, "run": {"lrr": 1}, "methods": {"asylpg": {}}}, "unknown key"),
    ({"experiment": {"target": 0.1}, "run": {"lr": "fast"}, "methods": {"asylpg": {}}}, "run.lr must be float"),
    ({"experiment": {"target": 0.1}, "methods": {"foo": {}}}, "unknown algorithm"),
    ({"experiment": {"target": 0.1, "target_gap": 0.01}, "methods": {"asylpg": {}}}, "exactly one of target"),
    ({"experiment": {"target": 0.1}, "methods": {}}, "nothing to run"),
    ({"experiment": {"target": 0.1}, "methods": {"asylpg": {"workers": 0}}}, "workers"),
    ({"experiment": {"target": 0.1}, "methods": {"asylpg": {}}, "extra": {}}, "unknown section"),
    ({"experiment": {"target": 0.1, "baseline": "qsvrg"}, "methods": {"asylpg": {}}}, "baseline"),
])
def test_bad_configs_are_refused(raw, msg) -> None:
    with pytest.raises(DQConfigError, match=msg):
        build(raw)


def test_cli_list(capsys) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(a in out for a in ALGORITHMS) and all(c in out for c in SHIPPED)
    assert main(["run", "--config", "no-such-config"]) == 2


def test_quick_run_writes_jsonl_figures_and_report(tmp_path) -> None:
    cfg = tmp_path / "dq-tiny.toml"
    cfg.write_text("\n".join([
        "# python -m dqsgd.dq run --config dq-tiny (test)",
        "[experiment]", 'name = "dq-tiny"', "target_gap = 0.5", "mu_sweep = [0.1, 0.5, 2.0]", "phi_sweep = [4, 16]",
        "[problem]", 'dataset = "synthetic"', 'model = "logreg"', "l2 = 1e-4",
        "[run]", "workers = 3", "epochs = 2", "lr = 0.1", "eval_every = 8",
        *[f"[methods.{a}]" for a in ALGORITHMS]]))
    assert main(["run", "--config", str(cfg), "--quick", "--out", str(tmp_path / "runs"),
                 "-o", "experiment.fstar_iters=15"]) == 0
    out = tmp_path / "runs" / "dq-tiny"
    doc = json.loads((out / "results.json").read_text())
    assert doc["fstar"] is not None and abs(doc["target"] - doc["fstar"] - 0.5) < 1e-9  # F* by L-BFGS
    labels = set(doc["runs"])
    assert set(ALGORITHMS) <= labels and "asylpg-mu0.1" in labels and "sparse-asylpg-phi4" in labels
    assert "asylpg-mu2" not in labels  # --quick keeps two sweep values
    for label in labels:
        lines = [json.loads(x) for x in (out / f"{label}.jsonl").read_text().splitlines()]
        assert lines[-1]["event"] == "summary" and all(x["event"] == "eval" for x in lines[:-1])
        bits = [x["bits"] for x in lines[:-1]]
        assert bits == sorted(bits)  # cumulative, measured
    report = (out / "report.md").read_text()
    assert "× vs asyfpg" in report and "μ vs bits" in report and "φ ablation" in report
    for png in ("loss_vs_bits.png", "loss_vs_time.png", "mu_vs_bits.png", "phi_vs_bits.png"):
        assert (out / png).stat().st_size > 1000
