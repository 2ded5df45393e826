"""The TensorBoard logger mirrors metrics.jsonl: an event file written by a run and read back."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("tensorboard", reason="tensorboard is an optional extra (pip install 'dqsgd[tensorboard]')")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from dqsgd.data import load_dataset  # noqa: E402
from dqsgd.method.config import method_config  # noqa: E402
from dqsgd.train.config import MethodEntry, TrainConfig  # noqa: E402
from dqsgd.train.metrics import read_jsonl  # noqa: E402
from dqsgd.train.runner import run_one  # noqa: E402


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_event_file_matches_the_jsonl_record(tmp_path: Path) -> None:
    cfg = TrainConfig(name="t", dataset="synthetic", model="mlp", workers=2, steps=6, batch_size=8, lr=0.1,
                      eval_every=3, tensorboard=True)
    entry = MethodEntry("dqsgd", method_config("dqsgd"))  # budgeted: budget_left is logged
    s = run_one(cfg, entry, load_dataset("synthetic"), 0, tmp_path / "run", progress=False)
    recs = list(read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    ev = _scalars(tmp_path / "run" / "tensorboard")
    f32 = dict(rel_tol=1e-6, abs_tol=1e-7)  # event files hold float32
    assert [st for st, _ in ev["train/loss"]] == [r["step"] for r in recs]
    assert all(math.isclose(v, r["loss"], **f32) for (_, v), r in zip(ev["train/loss"], recs))
    assert [v for _, v in ev["comm/bits"]] == [r["bits"] for r in recs]
    assert [v for _, v in ev["comm/up_bytes"]] == [r["up_bytes"] for r in recs]
    evals = [r for r in recs if "test_acc" in r]
    assert [st for st, _ in ev["test/accuracy"]] == [r["step"] for r in evals] and len(evals) == 2
    assert all(math.isclose(v, r["test_acc"], **f32) for (_, v), r in zip(ev["test/accuracy"], evals))
    assert math.isclose(ev["comm/up_MB_total"][-1][1], s["ledger_up_bytes"] / 1e6, rel_tol=1e-6)
    assert [v for _, v in ev["comm/budget_left_bits"]] == [float(r["budget_left"]) for r in recs]


def test_tensorboard_dir_puts_runs_under_label_and_seed(tmp_path: Path) -> None:
    cfg = TrainConfig(name="t", dataset="synthetic", model="mlp", workers=2, steps=2, batch_size=8, lr=0.1,
                      eval_every=2, tensorboard_dir=str(tmp_path / "tb"))
    run_one(cfg, MethodEntry("sgd", method_config("sgd")), load_dataset("synthetic"), 1, tmp_path / "run",
            progress=False)
    assert [st for st, _ in _scalars(tmp_path / "tb" / "sgd" / "seed1")["train/loss"]] == [0, 1]
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_resumed_run_hides_what_the_interrupted_process_logged_after_its_checkpoint(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    from dqsgd.train.checkpoint import save_checkpoint
    from dqsgd.train.trainer import Trainer

    cfg = TrainConfig(name="t", dataset="synthetic", model="mlp", workers=2, steps=6, batch_size=8, lr=0.1,
                      eval_every=3, checkpoint_every=3, tensorboard=True)
    entry, data = MethodEntry("dqsgd", method_config("dqsgd")), load_dataset("synthetic")
    full = run_one(cfg, entry, data, 0, tmp_path / "full", progress=False)
    part = tmp_path / "part"
    tr = Trainer(cfg, entry, data, 0)
    for _ in range(3):
        tr.step()
    save_checkpoint(tr, part / "checkpoint.pt")
    stale = SummaryWriter(log_dir=str(part / "tensorboard"))  # the killed process got to step 4
    for step in range(5):
        stale.add_scalar("train/loss", 999.0, step)
    stale.close()
    run_one(cfg, entry, data, 0, part, resume=True, progress=False)
    want, got = _scalars(tmp_path / "full" / "tensorboard"), _scalars(part / "tensorboard")
    assert [st for st, _ in got["train/loss"]] == [0, 1, 2, 3, 4, 5]
    assert [v for _, v in got["train/loss"][3:]] == [v for _, v in want["train/loss"][3:]]
    assert got["comm/up_MB_total"][-1] == want["comm/up_MB_total"][-1]
    assert math.isclose(got["comm/up_MB_total"][-1][1], full["ledger_up_bytes"] / 1e6, rel_tol=1e-6)
