"""Fake run directories, written here in exactly the format `dqsgd compare` writes.

ROOT/experiment.toml (first comment line = the command, [methods.*] in a non-alphabetical order),
ROOT/LABEL/seedK/config.json (static facts) and ROOT/LABEL/seedK/metrics.jsonl (one JSON line per
step; eval lines carry test_acc/test_loss). Every number is chosen here so that the tests can
recompute the tables by hand.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from dqsgd.method.config import method_config
from dqsgd.train.config import TrainConfig

D, W, STEPS, EVAL_EVERY = 1000, 4, 40, 10
HEADER = 16  # bytes per worker message besides the codes (made up; only the total matters)

TOML = """\
# dqsgd compare --config fake-table1   (a test fixture)
# Methods deliberately not in alphabetical order.
[train]
name = "fake-table1"
dataset = "{dataset}"
model = "cnn"
workers = {W}
steps = {STEPS}
eval_every = {EVAL_EVERY}
seeds = [0, 1]

[methods.sgd]

[methods.qsgd-4bit]

[methods.dqsgd]
target_bits = 4.5
"""

# Final test accuracy per (method, seed): qsgd-4bit stays within 0.5 pt of SGD, dqsgd does not.
FINAL_ACC = {("sgd", 0): 0.900, ("sgd", 1): 0.910, ("qsgd-4bit", 0): 0.902, ("qsgd-4bit", 1): 0.905,
             ("dqsgd", 0): 0.880, ("dqsgd", 1): 0.870}


def bits_of(label: str, step: int) -> int:
    if label.startswith("qsgd-"):
        return int(label.removeprefix("qsgd-").removesuffix("bit"))
    return 32 if label == "sgd" else 4 + step % 2  # dqsgd alternates 4, 5


def up_of(label: str, step: int) -> int:
    """Uplink bytes of all W workers at ``step``: packed codes + a header per worker."""
    return W * (math.ceil(D * bits_of(label, step) / 8) + HEADER)


def coded_of(label: str, step: int) -> int:
    """The same uplink with the best coding: 2 bits per coordinate fewer (fp32 SGD: as sent)."""
    if label == "sgd":
        return up_of(label, step)
    return W * (math.ceil(D * (bits_of(label, step) - 2) / 8) + HEADER)


def write_toml(root: Path, dataset: str = "mnist") -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "experiment.toml").write_text(TOML.format(dataset=dataset, W=W, STEPS=STEPS, EVAL_EVERY=EVAL_EVERY))


def write_run(root: Path, label: str, seed: int, *, final_acc: float | None, steps: int = STEPS,
              skipped: tuple[int, ...] = (), evals: bool = True, dataset: str = "mnist",
              stand_in_for: str | None = None, train_over: dict[str, Any] | None = None, coded_every: int = 0) -> Path:
    """``coded_every`` = k > 0: lines of the steps n % k == 0 carry ``coded_up_bytes`` (0: none, as
    runs from before the coded sizes were recorded)."""
    run = root / label / f"seed{seed}"
    run.mkdir(parents=True, exist_ok=True)
    train = dataclasses.asdict(TrainConfig(name="fake-table1", dataset=dataset, model="cnn", workers=W, steps=STEPS,
                                           eval_every=EVAL_EVERY, seeds=(0, 1)))
    train["seeds"] = list(train["seeds"])
    train.update(train_over or {})
    if not coded_every:
        train.pop("coded_every")
    else:
        train["coded_every"] = coded_every
    mcfg = dataclasses.asdict(method_config(label, **({"target_bits": 4.5} if label == "dqsgd" else {})))
    facts = {"method": label, "method_config": mcfg, "train_config": train, "dataset": dataset,
             "stand_in_for": stand_in_for, "seed": seed, "numel": D, "workers": W, "lr": train["lr"],
             "budget_bits": None}
    (run / "config.json").write_text(json.dumps(facts, indent=2))
    lines = []
    for n in range(steps):
        skip = n in skipped
        rec: dict[str, Any] = {
            "step": n, "loss": None if skip else 2.3 - 0.02 * n + 0.01 * seed, "lr": 0.05, "bits": bits_of(label, n),
            "skipped": skip, "up_bytes": 0 if skip else up_of(label, n), "down_bytes": 0 if skip else W * 4 * D,
            "side_bytes": 0, "budget_left": None, "compute_s": 0.01, "encode_s": 0.002, "decode_s": 0.003}
        if coded_every and not skip and n % coded_every == 0:
            rec["coded_up_bytes"] = coded_of(label, n)
        if evals and final_acc is not None and ((n + 1) % EVAL_EVERY == 0 or n == steps - 1):
            rec.update(test_acc=final_acc - 0.01 * (steps - 1 - n) / EVAL_EVERY, test_loss=0.3)
        lines.append(json.dumps(rec))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def make_root(root: Path, dataset: str = "mnist", stand_in_for: str | None = None) -> Path:
    """sgd + qsgd-4bit + dqsgd, seeds 0 and 1, everything finished and evaluated."""
    write_toml(root, dataset)
    for (label, seed), acc in FINAL_ACC.items():
        write_run(root, label, seed, final_acc=acc, dataset=dataset, stand_in_for=stand_in_for)
    return root
