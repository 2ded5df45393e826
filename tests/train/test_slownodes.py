"""The slow-node model, the simulated wall clock and backup workers (simulation)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.topology.ledger import Ledger
from dqsgd.train.config import ConfigError, MethodEntry, TrainConfig
from dqsgd.train.slownodes import SlowNodes, arrivals, check_backup_keys
from dqsgd.train.trainer import Trainer, record_of
from dqsgd.transport import SimTransport

CFG = TrainConfig(name="slow", dataset="synthetic", model="mlp", workers=4, steps=6, batch_size=16, lr=0.1,
                  eval_every=100, coded_every=0)
QSGD = MethodEntry("qsgd", method_config("qsgd"))


def test_compute_times_are_seeded_lognormal_with_rare_stalls() -> None:
    m = SlowNodes(dataclasses.replace(CFG, compute_s=0.2, compute_sigma=0.3, stall_prob=0.05, stall_s=10.0))
    assert np.array_equal(m.compute_times(7, 3, 8), m.compute_times(7, 3, 8))
    assert not np.array_equal(m.compute_times(7, 3, 8), m.compute_times(7, 4, 8))
    t = np.concatenate([m.compute_times(1, n, 8) for n in range(2000)])
    stalled = t >= 10.0
    n, p = t.size, 0.05
    assert abs(stalled.mean() - p) < 4 * math.sqrt(p * (1 - p) / n)
    logs = np.log(t[~stalled])  # log-normal: log T ~ N(log 0.2, 0.3²)
    assert abs(logs.mean() - math.log(0.2)) < 4 * 0.3 / math.sqrt(logs.size)
    assert abs(logs.std() - 0.3) < 4 * 0.3 / math.sqrt(2 * logs.size)


def test_arrivals_keep_the_earliest_and_break_ties_by_worker() -> None:
    assert arrivals([0.3, 0.1, 0.3, 0.2], 3) == ([0, 1, 3], [2], 0.3)
    assert arrivals([0.5, 0.5, 0.5], 1) == ([0], [1, 2], 0.5)


def _train(cfg: TrainConfig, entry: MethodEntry = QSGD, slow_worker: int | None = None,
           monkeypatch: pytest.MonkeyPatch | None = None) -> tuple[Trainer, list[dict]]:
    if slow_worker is not None and monkeypatch is not None:
        honest = SlowNodes.compute_times

        def stalled(self: SlowNodes, seed: int, step: int, workers: int) -> np.ndarray:
            t = honest(self, seed, step, workers)
            t[slow_worker] = math.inf  # this worker never arrives (stalled or killed)
            return t

        monkeypatch.setattr(SlowNodes, "compute_times", stalled)
    tr = Trainer(cfg, entry, load_dataset("synthetic"), 0)
    return tr, [record_of(tr.step(), tr.ledger) for _ in range(cfg.steps)]


def test_sim_time_adds_the_slowest_arrival_and_the_busiest_links(monkeypatch: pytest.MonkeyPatch) -> None:
    tr, recs = _train(CFG)
    model, total = SlowNodes(CFG), 0.0
    for n, (rec, led) in enumerate(zip(recs, tr.ledger.records)):
        busiest = max(a + b for a, b in zip(led.rank_up, led.rank_down))
        total += float(model.compute_times(0, n, 4).max()) + model.comm_s(busiest, 2)
        assert rec["sim_time_s"] == pytest.approx(total, rel=1e-12)
        assert "dropped" not in rec


@pytest.mark.parametrize("backup", [1, 2])
def test_a_stalled_worker_does_not_stop_training_with_backup_workers(backup: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = dataclasses.replace(CFG, backup_workers=backup)
    tr, recs = _train(cfg, slow_worker=2, monkeypatch=monkeypatch)
    assert tr.next_step == cfg.steps and all(math.isfinite(r["sim_time_s"]) for r in recs)
    assert all(2 in r["dropped"] and len(r["dropped"]) == backup for r in recs)
    led = tr.ledger
    assert led.wasted_up_bytes == sum(rec.up_bytes[w] for rec in led.records for w in rec.dropped) > 0
    assert all(len(rec.up_bytes) == 4 and rec.dropped == r["dropped"] for rec, r in zip(led.records, recs))
    assert bool(torch.isfinite(tr.flat_params()).all())


def test_without_backup_workers_a_stalled_worker_stalls_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    _, recs = _train(CFG, slow_worker=2, monkeypatch=monkeypatch)
    assert math.isinf(recs[0]["sim_time_s"])


def test_backup_average_is_the_mean_of_the_used_workers() -> None:
    """One step with b = 1: the update is exactly the mean of the W - 1 used workers' decoded payloads."""
    cfg = dataclasses.replace(CFG, backup_workers=1, momentum=0.0, steps=1)
    tr = Trainer(cfg, MethodEntry("sgd", method_config("sgd")), load_dataset("synthetic"), 0)
    before = tr.flat_params()
    grads, _ = tr.local_gradients(0)
    rec = record_of(tr.step(), tr.ledger)
    used = [w for w in range(4) if w not in rec["dropped"]]
    total = torch.zeros_like(before)
    for w in used:  # worker order, float32: the server's sum
        total = total + grads[w]
    assert torch.allclose(tr.flat_params(), before - 0.1 * (total / 3), rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", ["terngrad", "ef-signsgd", "sketched-sgd"])
def test_backup_workers_refuse_coupled_methods(name: str) -> None:
    with pytest.raises(ValueError, match="one independent message"):
        Trainer(dataclasses.replace(CFG, backup_workers=1), MethodEntry(name, method_config(name)),
                load_dataset("synthetic"), 0)


def test_backup_workers_need_the_ps_simulation() -> None:
    cfg = dataclasses.replace(CFG, backup_workers=1, topology="allgather")
    with pytest.raises(ValueError, match="topology 'ps'"):
        Trainer(cfg, QSGD, load_dataset("synthetic"), 0, SimTransport(4, "allgather"))
    with pytest.raises(ConfigError, match="backup_workers"):
        dataclasses.replace(CFG, backup_workers=4)
    with pytest.raises(ConfigError, match="stall_prob"):
        dataclasses.replace(CFG, stall_prob=1.5)


def test_checkpoint_keeps_the_clock_and_the_dropped_workers() -> None:
    cfg = dataclasses.replace(CFG, backup_workers=1)
    tr, recs = _train(cfg)
    again = Trainer(cfg, QSGD, load_dataset("synthetic"), 0)
    again.load_state_dict(tr.state_dict())
    assert again.timer.elapsed == recs[-1]["sim_time_s"]
    assert [r.dropped for r in again.ledger.records] == [r["dropped"] for r in recs]
    assert Ledger.from_state_dict(tr.ledger.state_dict()).wasted_up_bytes == tr.ledger.wasted_up_bytes


def test_replay_drops_the_recorded_workers() -> None:
    """A run over processes records who was dropped at each step; the simulation replays exactly that
    (the bitwise equality with the processes is tests/distributed/test_backup_workers.py)."""
    cfg = dataclasses.replace(CFG, backup_workers=2)
    drops = [[0, 3], [1, 2], [2, 3], [0, 1], [1, 3], [0, 2]]
    tr = Trainer(cfg, QSGD, load_dataset("synthetic"), 0)
    tr.timer.backup.replay = dict(enumerate(drops))
    for _ in range(cfg.steps):
        assert tr.step().dropped == drops[tr.next_step - 1]
    assert [r.dropped for r in tr.ledger.records] == drops
    bad = Trainer(cfg, QSGD, load_dataset("synthetic"), 0)
    bad.timer.backup.replay = {0: [1]}
    with pytest.raises(ValueError, match="replay of step 0"):
        bad.step()


def test_late_uplinks_count_as_wasted_exactly_once() -> None:
    led = Ledger(100, 3)
    led.record(0, 4, [60, 70, 0], 50, dropped=[2])
    led.record(1, 4, [60, 0, 0], 50, dropped=[1, 2])
    led.record_late(0, 2, 65)  # read at the next step: sent, not used
    assert led.wasted_up_bytes == 65 and led.up_bytes == 60 + 70 + 65 + 60
    for args, msg in [((0, 2, 65), "already counted"), ((1, 0, 9), "not dropped"), ((5, 1, 9), "no exchange 5")]:
        with pytest.raises(ValueError, match=msg):
            led.record_late(*args)


class _ArrivalTransport(SimTransport):
    """What the trainer sees of dqsgd.transport.backup.BackupPSTransport before the first exchange."""

    arrival_order = True
    backup = 1

    def expect(self, exchanges: int) -> None:
        self.exchanges = exchanges


def test_backup_workers_over_processes_refuse_what_needs_every_rank() -> None:
    cfg = dataclasses.replace(CFG, backup_workers=1, topology="ps")
    t = _ArrivalTransport(4, "ps")
    Trainer(dataclasses.replace(cfg, local_steps=2), QSGD, load_dataset("synthetic"), 0, t)
    assert t.exchanges == 3  # the server drains the stragglers after the last of ceil(6 / 2) exchanges
    for kw, msg in [(dict(checkpoint_every=2), "checkpoint_every = 0"), (dict(coded_every=1), "coded_every = 0"),
                    (dict(on_nonfinite="skip"), "on_nonfinite = 'raise'"), (dict(backup_workers=2), "serves W - 1"),
                    (dict(local_steps=4, local_steps_min=2, local_period="adaptive"), "local_period = 'fixed'")]:
        with pytest.raises(ConfigError, match=msg):
            Trainer(dataclasses.replace(cfg, **kw), QSGD, load_dataset("synthetic"), 0, _ArrivalTransport(4, "ps"))
    with pytest.raises(ConfigError, match="need topology 'ps'"):  # what `dqsgd train --transport torch` checks first
        check_backup_keys(dataclasses.replace(cfg, topology="sharded"))
