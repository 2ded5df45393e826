"""Entropy-coded uplink sizes in training: what the trainer measures, when, and what it never changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from synthetic_runs import entry, train_config

from dqsgd.codecs import Coding, decode, encode
from dqsgd.data import load_dataset
from dqsgd.topology.ledger import Ledger
from dqsgd.train.checkpoint import save_checkpoint
from dqsgd.train.config import ConfigError, TrainConfig
from dqsgd.train.metrics import read_jsonl
from dqsgd.train.runner import run_one
from dqsgd.train.trainer import Trainer
from dqsgd.topology.group import UP
from dqsgd.transport import SimTransport

DATA = load_dataset("synthetic")
TOPOLOGIES = ("ps", "allgather", "sharded")


def cfg(**kw) -> TrainConfig:
    return train_config(**{**dict(name="c", workers=3, steps=7, eval_every=100), **kw})


def auto_len(payload: bytes) -> int:
    return len(encode(decode(payload), Coding.AUTO))


class Recording(SimTransport):
    """The simulation, keeping each step's uplink payloads per worker (sharded: the W shard payloads)."""

    def __init__(self, workers: int, topology: str):
        super().__init__(workers, topology)
        self.sent: list[list[list[bytes]]] = []

    def exchange_groups(self):  # type: ignore[no-untyped-def]
        """The exchange's ranks, each uplink collective recording the rank's payloads (its flag bytes cut;
        fixed widths: no padding): sharded, the all-to-all's W; ps and allgather, the gathered one."""
        groups, rows = super().exchange_groups(), []
        self.sent.append(rows)
        for g in groups.values():
            def all_to_all(send, send_sizes, recv_sizes, leg, real=g.all_to_all):  # type: ignore[no-untyped-def]
                rows.append([bytes(p[:-1].numpy()) for p in send.split(list(send_sizes))])
                return real(send, send_sizes, recv_sizes, leg)

            def gather(msg, dst, leg, real=g.gather):  # type: ignore[no-untyped-def]
                rows.append([bytes(msg[:-1].numpy())])
                return real(msg, dst, leg)

            def all_gather(msg, leg, real=g.all_gather):  # type: ignore[no-untyped-def]
                if leg == UP and msg.dtype == torch.uint8:
                    rows.append([bytes(msg[:-1].numpy())])
                return real(msg, leg)

            g.all_to_all, g.gather, g.all_gather = all_to_all, gather, all_gather  # type: ignore[method-assign]
        return groups


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("name", ["qsgd-4bit", "terngrad", "signsgd", "sgd"])
def test_recorded_sizes_are_the_auto_encodings_of_the_payloads_sent(topology: str, name: str) -> None:
    """Per step and worker: Σ over the worker's payloads of len(encode(decode(p), AUTO)) (fp32: len(p)),
    never more than what was sent with FIXED coding."""
    t = Recording(3, topology)
    tr = Trainer(cfg(topology=topology, steps=3), entry(name), DATA, 0, t)
    for _ in range(3):
        tr.step()
    assert len(tr.ledger.records) == len(t.sent) == 3
    for rec, rows in zip(tr.ledger.records, t.sent):
        want = [sum(len(p) if name == "sgd" else auto_len(p) for p in row) for row in rows]
        assert rec.coded_up == want, (rec.step, rec.coded_up, want)
        assert all(c <= u for c, u in zip(rec.coded_up, rec.up_bytes))
        if name == "sgd":
            assert rec.coded_up == rec.up_bytes


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_coded_ratio_beats_the_fixed_width_ratio_for_qsgd_4bit(topology: str) -> None:
    """QSGD's 4-bit levels of a gradient are far from uniform: rANS/zstd codes them in well under 4 bits."""
    tr = Trainer(cfg(topology=topology), entry("qsgd-4bit"), DATA, 0, SimTransport(3, topology))
    while tr.next_step < 7:
        tr.step()
    s = tr.ledger.summary()
    assert s["coded_steps"] == 7
    assert s["sent_ratio_coded_steps"] == pytest.approx(s["compression_ratio"])  # every step measured
    assert s["coded_ratio"] > 1.5 * s["compression_ratio"], s
    fp32 = 4 * tr.numel * 3 * 7
    assert s["coded_ratio"] == pytest.approx(fp32 / s["coded_up_bytes"])


def test_an_auto_coded_method_measures_exactly_what_it_sent() -> None:
    t = Recording(3, "sharded")
    tr = Trainer(cfg(topology="sharded"), entry("dqsgd", coding="auto"), DATA, 0, t)
    while tr.next_step < 4:
        tr.step()
    assert all(r.coded_up == r.up_bytes for r in tr.ledger.records)
    assert tr.ledger.coded_ratio() == pytest.approx(tr.ledger.compression_ratio())
    # Why the method may report its own length: re-encoding a sent AUTO payload gives the same length.
    assert all(auto_len(p) == len(p) for rows in t.sent for row in rows for p in row)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_coded_every_picks_the_steps_and_changes_nothing_else(tmp_path: Path, topology: str) -> None:
    runs = {k: run_one(cfg(topology=topology, steps=8, coded_every=k), entry("dqsgd"), DATA, 0, tmp_path / str(k),
                       progress=False) for k in (0, 1, 3)}
    recs = {k: list(read_jsonl(tmp_path / str(k) / "metrics.jsonl")) for k in runs}
    assert [r["step"] for r in recs[3] if "coded_up_bytes" in r] == [0, 3, 6]
    assert [r["step"] for r in recs[1] if "coded_up_bytes" in r] == list(range(8))
    assert not any("coded_up_bytes" in r for r in recs[0])
    by_step = {r["step"]: r["coded_up_bytes"] for r in recs[1]}
    assert all(r["coded_up_bytes"] == by_step[r["step"]] for r in recs[3] if "coded_up_bytes" in r)
    for k in (1, 3):  # a measurement only: same model, same widths, same bytes sent
        assert torch.equal(runs[k]["final_params"], runs[0]["final_params"])
        assert [(r["bits"], r["up_bytes"]) for r in recs[k]] == [(r["bits"], r["up_bytes"]) for r in recs[0]]
    assert runs[0]["ledger_coded_steps"] == 0 and runs[0]["ledger_coded_ratio"] is None
    assert runs[3]["ledger_coded_steps"] == 3
    assert runs[3]["ledger_coded_up_bytes"] == sum(by_step[s] for s in (0, 3, 6))
    fixed = sum(r["up_bytes"] for r in recs[3] if r["step"] in (0, 3, 6))
    assert runs[3]["ledger_sent_ratio_coded_steps"] == pytest.approx(4 * runs[3]["numel"] * 3 * 3 / fixed)


@pytest.mark.parametrize("topology", ["ps", "sharded"])
def test_resume_keeps_the_coded_sizes_exactly(tmp_path: Path, topology: str) -> None:
    c = cfg(topology=topology, steps=9, coded_every=2, checkpoint_every=4)
    full = run_one(c, entry("dqsgd"), DATA, 1, tmp_path / "full", progress=False)
    tr = Trainer(c, entry("dqsgd"), DATA, 1, SimTransport(3, topology))
    for _ in range(5):
        tr.step()
    save_checkpoint(tr, tmp_path / "part" / "checkpoint.pt")
    resumed = run_one(c, entry("dqsgd"), DATA, 1, tmp_path / "part", resume=True, progress=False)
    assert torch.equal(full["final_params"], resumed["final_params"])
    keys = ("ledger_coded_steps", "ledger_coded_up_bytes", "ledger_coded_ratio", "ledger_sent_ratio_coded_steps")
    assert {k: resumed[k] for k in keys} == {k: full[k] for k in keys}
    assert full["ledger_coded_steps"] == 5
    coded = lambda d: [(r["step"], r.get("coded_up_bytes")) for r in read_jsonl(d / "metrics.jsonl")]  # noqa: E731
    assert coded(tmp_path / "part") == coded(tmp_path / "full")[5:]  # the stopped run wrote no metrics


def test_ledger_keeps_coded_sizes_through_state_dicts_old_and_new() -> None:
    led = Ledger(100, 2, topology="ps")
    led.record(0, 4, [60, 60], 400, 8, [60, 400], [400, 400], coded_up=[30, 40])
    led.record(1, 4, [60, 60], 400, 8, [60, 400], [400, 400])
    led.record(2, 4, [50, 50], 400, 8, [50, 400], [400, 400])
    led.record_coded(2, [20, 30])
    assert [r.step for r in led.coded_records()] == [0, 2]
    assert led.coded_up_bytes() == 120
    side = 2 * 8 * 2 // 2  # the scalers' uplink half on the two measured steps, as in the measured ratio
    assert led.coded_ratio() == pytest.approx(800 * 2 / (120 + side))
    assert led.sent_ratio_coded_steps() == pytest.approx(800 * 2 / (220 + side))
    assert Ledger.from_state_dict(led.state_dict()) == led
    seven = {"numel": 100, "workers": 2, "budget_bits": None, "topology": "ps",
             "records": [[0, 4, [60, 60], 400, 0, [60, 400], [400, 400]]]}
    back = Ledger.from_state_dict(seven)
    assert back.records[0].coded_up is None and back.coded_ratio() is None
    assert back.summary()["coded_steps"] == 0
    with pytest.raises(ValueError, match="coded uplink sizes"):
        led.record(3, 4, [1, 1], 0, coded_up=[1])
    with pytest.raises(ValueError, match="no record of step 7"):
        led.record_coded(7, [1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        led.record_coded(2, [1, -1])


def test_negative_coded_every_is_refused() -> None:
    with pytest.raises(ConfigError, match="counts must be >= 0"):
        cfg(coded_every=-1)
