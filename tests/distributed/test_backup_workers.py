"""Backup workers over gloo: the server aggregates the first W − b arrivals; a stalled or killed worker
does not stop training, the metrics name the dropped workers, the ledger's used and wasted bytes are
exact, and the simulation replaying the recorded drops reaches the same parameters bitwise."""

import dataclasses

import pytest
import torch

import _ranks_backup
from dqsgd.cli.launch import spawn_local
from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.trainer import Trainer
from dqsgd.transport import SimTransport

pytestmark = pytest.mark.distributed

CFG = TrainConfig(name="backup", dataset="synthetic", model="mlp", workers=3, steps=10, batch_size=16, lr=0.1,
                  eval_every=100, topology="ps", backup_workers=1, coded_every=0, momentum=0.9)
QSGD = MethodEntry("qsgd", method_config("qsgd"))


def replay(cfg: TrainConfig, dropped: list[list[int]]) -> torch.Tensor:
    """The simulation with the recorded dropped workers of every step."""
    tr = Trainer(cfg, QSGD, load_dataset("synthetic"), 0, SimTransport(cfg.workers, "ps"))
    tr.timer.backup.replay = dict(enumerate(dropped))
    while tr.next_step < cfg.steps:
        tr.step()
    assert [r.dropped for r in tr.ledger.records] == dropped
    return tr.flat_params()


def check_server(server: dict, sent: dict[int, list[int]], cfg: TrainConfig) -> None:
    """Every step: b workers dropped, the metrics say which; every byte the ledger holds is one a worker sent."""
    assert all(len(d) == cfg.backup_workers and 0 not in d for d in server["dropped"])
    assert server["metrics_dropped"] == server["dropped"]
    used = wasted = 0
    for n, (row, dropped) in enumerate(zip(server["up"], server["dropped"])):
        for w, nbytes in enumerate(row):
            if w in sent:  # a live worker: its every payload was read (used, or late and discarded)
                assert nbytes == sent[w][n], (n, w)
        used += sum(b for w, b in enumerate(row) if w not in dropped)
        wasted += sum(b for w, b in enumerate(row) if w in dropped)
    assert server["wasted"] == wasted and server["total_up"] == used + wasted


@pytest.mark.timeout(150)
@pytest.mark.slow
def test_a_stalled_and_a_killed_worker_are_dropped_and_the_simulation_replays_the_run_bitwise() -> None:
    """W = 4, b = 2: rank 2 sleeps 3 s and rank 3 is SIGKILLed before step 3. Training goes on without
    them; the stalled one's late payloads are read at the end and counted as wasted."""
    cfg = dataclasses.replace(CFG, workers=4, backup_workers=2)
    results = spawn_local(_ranks_backup.train_backup, 4, (cfg, QSGD, {2: "stall", 3: "kill"}, 3, 3.0), timeout=30,
                          deadline=130)
    assert results[3].exitcode == -9
    assert all(r.ok for r in results[:3]), [r.describe() for r in results]
    server = results[0].value
    sent = {r.rank: r.value["sent"] for r in results[:3]}
    assert all(len(s) == cfg.steps for s in sent.values())
    check_server(server, sent, cfg)
    assert all(d == [2, 3] for d in server["dropped"][3:])  # asleep then behind, and dead
    assert all(row[3] == 0 for row in server["up"][3:])     # nothing the dead worker did not send is counted
    assert server["wasted"] >= sum(sent[2][3:]) > 0         # the stalled worker's late payloads were read
    for r in results[1:3]:  # every live rank applied the same updates
        assert torch.equal(r.value["params"], server["params"])
    assert torch.equal(replay(cfg, server["dropped"]), server["params"])
