"""End-to-end training in simulation: pinned seeded run, reproducibility, exact resume, bad input."""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from synthetic_runs import entry, train_config

from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.train.checkpoint import CheckpointError, load_checkpoint
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.metrics import read_jsonl
from dqsgd.train.runner import run_one
from dqsgd.train.trainer import Trainer

DATA = load_dataset("synthetic")


cfg = train_config


def bits_of(run: Path) -> list[int]:
    return [r["bits"] for r in read_jsonl(run / "metrics.jsonl")]


def test_pinned_seeded_run(tmp_path: Path) -> None:
    """Loss and chosen bits of a tiny seeded DQSGD run with the torch kernel are pinned (CPU, this torch build)."""
    s = run_one(cfg(steps=20, lr=0.3), entry("dqsgd", target_bits=3.5, kernel="torch"), DATA, 0, tmp_path,
                progress=False)
    recs = list(read_jsonl(tmp_path / "metrics.jsonl"))
    bits = [r["bits"] for r in recs]
    losses = [r["loss"] for r in recs]
    assert bits == PINNED_BITS, bits
    assert losses[0] == pytest.approx(PINNED_LOSS0, rel=1e-5)
    assert losses[-1] == pytest.approx(PINNED_LOSS_LAST, rel=1e-5)
    assert s["ledger_budget_left"] >= 0


PINNED_BITS = [3, 4, 3, 4, 3, 3, 4, 3, 3, 4, 4, 4, 4, 4, 3, 3, 3, 4, 3, 3]  # the norm trend from the tenth step (N <= 200)
PINNED_LOSS0 = 2.325085759162903
PINNED_LOSS_LAST = 1.0734637677669525


def test_pinned_seeded_run_default_fused_kernel(tmp_path: Path) -> None:
    """The same run with the default kernel ("fused": hash uniforms of (seed, step, worker))."""
    run_one(cfg(steps=20, lr=0.3), entry("dqsgd", target_bits=3.5), DATA, 0, tmp_path, progress=False)
    recs = list(read_jsonl(tmp_path / "metrics.jsonl"))
    assert [r["bits"] for r in recs] == [3, 4, 3, 3, 3, 3, 4, 3, 4, 4, 4, 4, 4, 4, 4, 3, 3, 3, 3, 4]
    assert recs[0]["loss"] == pytest.approx(PINNED_LOSS0, rel=1e-5)  # step 0's loss precedes any update
    assert recs[-1]["loss"] == pytest.approx(1.063007727265358, rel=1e-5)


@pytest.mark.parametrize("name", ["dqsgd", "terngrad", "adaqs"])
def test_same_seed_identical_twice_and_methods_share_data(tmp_path: Path, name: str) -> None:
    a = run_one(cfg(), entry(name), DATA, 3, tmp_path / "a", progress=False)
    b = run_one(cfg(), entry(name), DATA, 3, tmp_path / "b", progress=False)
    assert torch.equal(a["final_params"], b["final_params"])
    la = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    lb = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    strip = lambda line: {k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
    assert [strip(x) for x in la] == [strip(x) for x in lb]


def test_common_random_numbers_same_init_and_batches() -> None:
    t1 = Trainer(cfg(), entry("sgd"), DATA, 5)
    t2 = Trainer(cfg(), entry("qsgd", bits=2), DATA, 5)
    assert torch.equal(t1.flat_params(), t2.flat_params())
    for w in range(4):
        assert torch.equal(t1.batches.indices(w, 7), t2.batches.indices(w, 7))


@pytest.mark.parametrize("name", ["dqsgd", "ef-signsgd", "adaqs"])
def test_resume_from_checkpoint_is_exact(tmp_path: Path, name: str) -> None:
    c = cfg(steps=14, checkpoint_every=5)
    full = run_one(c, entry(name), DATA, 1, tmp_path / "full", progress=False)
    part = tmp_path / "part"
    # Interrupted run: stop after 8 steps (checkpoint at step 5), then resume.
    tr = Trainer(c, entry(name), DATA, 1)
    from dqsgd.train.checkpoint import save_checkpoint

    for _ in range(5):
        tr.step()
    save_checkpoint(tr, part / "checkpoint.pt")
    resumed = run_one(c, entry(name), DATA, 1, part, resume=True, progress=False)
    assert torch.equal(full["final_params"], resumed["final_params"])
    assert resumed["ledger_up_bytes"] == full["ledger_up_bytes"]
    assert resumed["ledger_budget_left"] == full["ledger_budget_left"]


def test_checkpoint_for_another_run_refused(tmp_path: Path) -> None:
    c = cfg(steps=4, checkpoint_every=2)
    run_one(c, entry("qsgd"), DATA, 0, tmp_path, progress=False)
    other = Trainer(cfg(steps=4), entry("qsgd"), DATA, seed=9)
    with pytest.raises(CheckpointError, match="seed: 0 saved, 9 here"):
        load_checkpoint(other, tmp_path / "checkpoint.pt")
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot load"):
        load_checkpoint(other, tmp_path / "bad.pt")


def test_nonfinite_gradients_refused_or_skipped(tmp_path: Path) -> None:
    c = cfg(steps=6, lr=1e30)  # the update explodes the model: the next gradients are not finite
    with pytest.raises(ValueError, match="NaN or Inf"):
        run_one(c, entry("qsgd"), DATA, 0, tmp_path / "raise", progress=False)
    with pytest.warns(RuntimeWarning, match="is skipped on every rank"):  # the first skip is said once
        s = run_one(TrainConfig(**{**c.__dict__, "on_nonfinite": "skip"}), entry("qsgd"), DATA, 0,
                    tmp_path / "skip", progress=False)
    assert s["skipped_steps"] >= 1


@pytest.mark.timeout(900)  # about 30 s on an idle 2-core machine; several times that under load
def test_sigkill_mid_run_then_resume_matches_uninterrupted(tmp_path: Path) -> None:
    """Kill a real `dqsgd train` process with SIGKILL, resume it, compare with an uninterrupted run."""
    steps = 100  # the equality is bitwise at any length; 100 leaves 60 steps after the kill at 40
    args = ["--config", "table1-mnist", "--method", "dqsgd", "--quiet", "--set", 'train.dataset="synthetic"',
            "--set", 'train.model="mlp"', "--set", f"train.steps={steps}", "--set", "train.workers=4",
            "--set", "train.batch_size=16", "--set", "train.checkpoint_every=10", "--set", "train.eval_every=50",
            "--set", "train.threads=1"]  # one torch thread: OpenMP threads spin for nothing on a busy machine
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dqsgd", "train"]
    from dqsgd.cli import main

    assert main(["train", *args, "--out", str(tmp_path / "full")]) == 0  # in this process: one interpreter start less
    run = tmp_path / "killed"
    proc = subprocess.Popen(cmd + args + ["--out", str(run)], env=env)
    try:
        deadline = 120.0
        import time

        t0 = time.monotonic()
        while time.monotonic() - t0 < deadline:  # wait for a checkpoint and a few more steps
            if (run / "checkpoint.pt").exists() and sum(1 for _ in open(run / "metrics.jsonl")) > 40:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    done = sum(1 for _ in open(run / "metrics.jsonl"))
    assert done < steps, "the process finished before it was killed"
    subprocess.run(cmd + args + ["--resume", str(run)], check=True, env=env, timeout=300)
    full = list(read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    resumed = list(read_jsonl(run / "metrics.jsonl"))
    key = lambda r: (r["step"], r["bits"], r["up_bytes"], r["budget_left"], r["loss"], r.get("test_acc"))
    assert [key(r) for r in resumed] == [key(r) for r in full]


def test_fused_kernel_through_the_trainer_is_reproducible_and_resumes(tmp_path: Path) -> None:
    """kernel = "fused": hash uniforms of (seed, step, worker); resume needs no generator state."""
    c = cfg(steps=10, checkpoint_every=4)
    e = MethodEntry("dqsgd", method_config("dqsgd", kernel="fused"))
    full = run_one(c, e, DATA, 2, tmp_path / "full", progress=False)
    again = run_one(c, e, DATA, 2, tmp_path / "again", progress=False)
    assert torch.equal(full["final_params"], again["final_params"])
    torch_path = run_one(c, entry("dqsgd", kernel="torch"), DATA, 2, None, progress=False)
    assert not torch.equal(full["final_params"], torch_path["final_params"])  # a different uniform stream
    tr = Trainer(c, e, DATA, 2)
    from dqsgd.train.checkpoint import save_checkpoint

    for _ in range(4):
        tr.step()
    save_checkpoint(tr, tmp_path / "part" / "checkpoint.pt")
    resumed = run_one(c, e, DATA, 2, tmp_path / "part", resume=True, progress=False)
    assert torch.equal(full["final_params"], resumed["final_params"])


@pytest.mark.parametrize("model", ["mlp", "logreg"])
def test_vmap_workers_computes_the_same_gradients(model: str) -> None:
    """train.vmap_workers: all W gradients in one torch.func.vmap call equal the one-by-one loop
    (to float32 rounding, not bitwise), losses included; a plain-SGD run stays on the same path."""
    c = cfg(model=model, weight_decay=1e-3)
    loop, vm = Trainer(c, entry("sgd"), DATA, 3), Trainer(TrainConfig(**{**c.__dict__, "vmap_workers": True}),
                                                          entry("sgd"), DATA, 3)
    for step in range(3):
        (g1, l1), (g2, l2) = loop.local_gradients(step), vm.local_gradients(step)
        assert sorted(g1) == sorted(g2) == list(range(c.workers))
        for w in g1:
            assert torch.allclose(g1[w], g2[w], rtol=1e-5, atol=1e-7), (step, w)
        assert l1 == pytest.approx(l2, rel=1e-6)
        loop.step(), vm.step()
    assert torch.allclose(loop.flat_params(), vm.flat_params(), atol=1e-6)


def test_vmap_workers_refuses_models_with_buffers() -> None:
    data = load_dataset("synthetic")
    with pytest.raises(ValueError, match="has buffers.*BatchNorm"):
        Trainer(cfg(model="resnet18", vmap_workers=True), entry("sgd"), data, 0)


def test_resuming_a_finished_run_keeps_its_results(tmp_path: Path) -> None:
    c = cfg(steps=6, checkpoint_every=3)
    full = run_one(c, entry("dqsgd"), DATA, 0, tmp_path, progress=False)
    lines = (tmp_path / "metrics.jsonl").read_text()
    again = run_one(c, entry("dqsgd"), DATA, 0, tmp_path, resume=True, progress=False)
    assert (tmp_path / "metrics.jsonl").read_text() == lines  # nothing re-run, nothing lost
    assert again["test_acc"] == full["test_acc"] and not math.isnan(again["test_acc"])
    assert json.loads((tmp_path / "summary.json").read_text())["test_acc"] == full["test_acc"]
    assert torch.equal(again["final_params"], full["final_params"])
