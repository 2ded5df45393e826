"""Rank function for the Local SGD rows of benchmarks/network (spawned by ``dqsgd.cli.launch.spawn_local``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch


# DiLoCo (outer Nesterov) with budgeted coded DQSGD and the 3-bit error-fed downlink, at H = 2; and streaming:
# 2 fragments, each exchange applied a step after it is issued (with rounds = 2 the last complete at step 4)
DILOCO = "local-fashion-1500:diloco-h32-lr1-m05-dqsgd-coded-ef3+local_steps=2"
CONFIG_ROWS = (DILOCO, DILOCO + "+fragments=2+overlap_steps=1")


def local_rows(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Each Local SGD row with H = 2 on the synthetic MLP until just after an exchange — dqsgd's exchanges
    at its 2nd and 4th steps; PyTorch's averager counts from 0 (its 1st, 3rd, 5th) — and the parameters."""
    sys.path.insert(0, folder)
    import local_rows as rows  # the benchmark's helper module

    from dqsgd.data import load_dataset
    from dqsgd.models import build_model

    data = load_dataset("synthetic")
    out = {}
    for method in ("postlocal-h2", "local-h2", "local-h2-qsgd-4bit", *CONFIG_ROWS):
        a = argparse.Namespace(method=method, rank=rank, workers=world, seed=0, lr=0.1, momentum=0.9, steps=4,
                               batch_size=16, timeout=30.0)
        step, model, _ = rows.local_stepper(a, data, lambda: build_model("mlp", data))
        for n in range(5 if method.startswith("postlocal") else 4):
            step(n)
        out[method] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return out
