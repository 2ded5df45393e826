"""Topology sharded in one process: the two-stage estimator's statistics, the accounting, the caps."""

import math

import pytest
import torch

from dqsgd.kernels import HashRNG

from dqsgd.codecs import PayloadError
from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.topology.downspec import DownlinkSpec
from dqsgd.topology.ledger import Ledger, wire_traffic
from dqsgd.method.pipeline import Method
from dqsgd.theory import formulas as theory
from dqsgd.topology.refusal import check_table
from dqsgd.topology.step import ExchangeStep
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.trainer import Trainer
from dqsgd.transport import SimTransport

W, D, REPS = 3, 1001, 400


def _grads() -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {w: torch.randn(D, generator=gen) * (1.0 + w) for w in range(W)}


def _estimates(down_bits: int) -> tuple[torch.Tensor, ExchangeStep]:
    method = Method(method_config("qsgd", bits=3, kernel="fused"), D, 10)
    step = ExchangeStep(method, [D], W, seed=11, downlink=DownlinkSpec(down_bits))
    t, g = SimTransport(W, "sharded"), _grads()
    state = method.init_state(W)  # qsgd at 3 bits
    out = [step.run(t, g, state, n, {w: None for w in range(W)}).update for n in range(REPS)]
    return torch.stack(out).to(torch.float64), step


@pytest.mark.parametrize("down_bits", [4, 32])
def test_two_stage_estimator_is_unbiased_and_within_the_variance_bound(down_bits: int) -> None:
    est, step = _estimates(down_bits)
    g = _grads()
    mean_g = torch.stack([g[w] for w in range(W)]).to(torch.float64).mean(0)
    var_i = est.var(0, unbiased=True)                  # per coordinate, measured
    z = (est.mean(0) - mean_g) / torch.sqrt(var_i / REPS).clamp_min(1e-12)
    # 1001 coordinates: |z| > 5 has probability ~6e-7 each under the CLT; a bias of one step would show
    assert float(z.abs().max()) < 5.0
    # the whole-vector error of the mean: E‖m − ḡ‖² = V/R, concentrated over 1001 coordinates
    V = float(var_i.sum())
    assert float(((est.mean(0) - mean_g) ** 2).sum()) < 1.5 * V / REPS
    bound = sum(theory.two_stage_variance_bound([float(g[w][lo:hi].abs().max()) for w in range(W)], hi - lo, 3,
                                                None if down_bits == 32 else down_bits)
                for lo, hi in step.bounds)
    assert V <= bound
    if down_bits == 4:  # the downlink term is real: more variance than the fp32 downlink's bound allows
        up_only = sum(theory.two_stage_variance_bound([float(g[w][lo:hi].abs().max()) for w in range(W)], hi - lo,
                                                      3, None) for lo, hi in step.bounds)
        assert V > 0.5 * up_only


def test_two_stage_quantization_term_adds_the_downlink() -> None:
    norms, bits, w = [2.0, 1.0], [4, 3], [0.5, 0.25]
    single = theory.quantization_term(norms, bits, w)
    assert theory.two_stage_quantization_term(norms, bits, w, 1, None) == pytest.approx(single)
    two = theory.two_stage_quantization_term(norms, bits, w, 4, 8)
    assert two == pytest.approx(single / 4 + (0.5 * 4 + 0.25 * 1) / 127**2)
    # equal worker norms: the shard bound is c·d‖g‖²(1/(W s_up²) + 1/s_d²)
    b = theory.two_stage_variance_bound([3.0] * 4, 100, 4, 8, cell_factor=0.25)
    assert b == pytest.approx(0.25 * 100 * 9 * (1 / (4 * 49) + 1 / 127**2))


def test_wire_traffic_per_topology() -> None:
    up = [[10, 20, 30], [11, 21, 31], [12, 22, 32]]
    ru, rd = wire_traffic("sharded", up, [5, 6, 7])
    # rank 0 sends 20+30, receives 11+12; rank 1 sends 11+31, receives 20+22; rank 2 sends 12+22, receives 30+31
    assert ru == [50, 42, 61] and rd == [14, 14, 14]
    ru, rd = wire_traffic("ps", [[10], [12], [11]], [40])
    assert ru == [24, 12, 11] and rd == [80, 40, 40]
    ru, rd = wire_traffic("allgather", [[10], [12], [11]], [0])
    assert ru == [24, 24, 24] and rd == [0, 0, 0]
    with pytest.raises(ValueError, match="unknown topology"):
        wire_traffic("ring", up, [1])


def test_ledger_ratios_and_old_checkpoints() -> None:
    led = Ledger(100, 2, topology="ps")
    led.record(0, 4, [60, 60], 400, 0, [60, 400], [400, 400])
    assert led.compression_ratio() == pytest.approx(800 / 120)
    assert led.total_ratio() == pytest.approx(1600 / (120 + 800))
    assert led.busiest_rank_bytes()["rank_total_bytes"] == 800
    old = {"numel": 100, "workers": 2, "budget_bits": None, "records": [[0, 4, [60, 60], 400, 0]]}
    back = Ledger.from_state_dict(old)
    assert back.topology == "ps" and back.records[0].rank_up == [] and back.total_ratio() == led.total_ratio()
    assert Ledger.from_state_dict(led.state_dict()) == led


def test_the_size_table_refuses_a_payload_above_the_cap_before_decoding() -> None:
    with pytest.raises(PayloadError, match="rank 1 announced a payload of 5000 bytes"):
        check_table([[10, 10], [10, 5000]], [100, 100], "")
    method = Method(method_config("qsgd-4bit"), 1000, 10)
    assert method.max_payload_bytes(4) == len(method.encode(torch.randn(1000), 4, None, hash_rng=HashRNG(0, 0, 0))[0])


@pytest.mark.parametrize("name", ["qsgd", "terngrad", "signsgd", "sgd", "ef-signsgd", "dqsgd"])
@pytest.mark.parametrize("topology", ["ps", "sharded"])
def test_every_uplink_payload_fits_its_cap(name: str, topology: str) -> None:
    cfg = TrainConfig(name="cap", dataset="synthetic", model="mlp", workers=3, steps=3, batch_size=8, topology=topology)
    tr = Trainer(cfg, MethodEntry(name, method_config(name)), load_dataset("synthetic"), 0)
    seen: list[tuple[int, int]] = []  # (payload bytes, its cap)
    run = tr.step_runner.run

    def spy(t, grads, state, *a, **kw):  # type: ignore[no-untyped-def]
        out = run(t, grads, state, *a, **kw)
        caps = tr.step_runner.protocol.caps(state.bits)
        seen.extend((n, c) for row in out.up for n, c in zip(row, caps))
        return out

    if topology == "sharded":
        tr.step_runner.run = spy  # type: ignore[method-assign]
    for _ in range(3):
        r = tr.step()
        if topology == "ps":
            seen.extend((b, tr.method.max_payload_bytes(r.bits)) for b in tr.ledger.records[-1].up_bytes)
        assert math.isfinite(r.loss)
    assert len(seen) == 3 * 3 * (3 if topology == "sharded" else 1)
    assert all(n <= cap for n, cap in seen), seen
    if name in ("qsgd", "terngrad", "signsgd", "sgd"):  # fixed coding: the cap is the exact size
        assert all(n == cap for n, cap in seen)


def test_one_worker_sharded_equals_ps_bitwise() -> None:
    """W = 1: one shard, the same uniforms (worker 0, shard 0) and an fp32 downlink: the same run."""
    data = load_dataset("synthetic")
    runs = {}
    for topo in ("ps", "sharded"):
        cfg = TrainConfig(name="one", dataset="synthetic", model="mlp", workers=1, steps=4, batch_size=8,
                          topology=topo, downlink_bits=32)
        tr = Trainer(cfg, MethodEntry("qsgd", method_config("qsgd", kernel="fused")), data, 0)
        for _ in range(4):
            tr.step()
        runs[topo] = tr.flat_params()
    assert torch.equal(runs["ps"], runs["sharded"])


def test_sharded_needs_a_coordinate_per_shard() -> None:
    with pytest.raises(ValueError, match="at least one coordinate per shard"):
        ExchangeStep(Method(method_config("qsgd"), 3, 10), [3], 4, seed=0)
    with pytest.raises(ValueError, match="downlink_bits"):
        ExchangeStep(Method(method_config("qsgd"), 30, 10), [30], 4, seed=0, downlink=DownlinkSpec(1))


def test_sharded_run_resumes_from_a_checkpoint_bitwise(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dqsgd.train.checkpoint import load_checkpoint, save_checkpoint

    data = load_dataset("synthetic")
    cfg = TrainConfig(name="ck", dataset="synthetic", model="mlp", workers=3, steps=6, batch_size=8, momentum=0.9,
                      topology="sharded")
    entry = MethodEntry("dqsgd", method_config("dqsgd"))
    full = Trainer(cfg, entry, data, 0)
    for _ in range(6):
        full.step()
    first = Trainer(cfg, entry, data, 0)
    for _ in range(3):
        first.step()
    save_checkpoint(first, tmp_path / "ck.pt")
    second = Trainer(cfg, entry, data, 0)
    load_checkpoint(second, tmp_path / "ck.pt")
    for _ in range(3):
        second.step()
    assert torch.equal(second.flat_params(), full.flat_params())
    assert [r.bits for r in second.ledger.records] == [r.bits for r in full.ledger.records]
    assert second.ledger == full.ledger


def test_cli_topology_flag_reaches_the_run(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`dqsgd train --topology sharded` (simulation): config.json and the metrics carry it."""
    import json

    from dqsgd.cli.commands import main

    out = tmp_path / "run"
    args = ["train", "--config", "table1-mnist", "--method", "qsgd-4bit", "--quiet", "--topology", "sharded",
            "--set", 'train.dataset="synthetic"', "--set", 'train.model="mlp"', "--set", "train.steps=2",
            "--set", "train.workers=3", "--set", "train.batch_size=8", "--out", str(out)]
    assert main(args) == 0
    assert "uplink ratio" in capsys.readouterr().out
    facts = json.loads((out / "config.json").read_text())
    assert facts["train_config"]["topology"] == "sharded"
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["rank_total_bytes"] == rec["rank_up_bytes"] + rec["rank_down_bytes"] > 0
