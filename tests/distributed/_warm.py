"""Imported by the forkserver of the multi-process tests (see conftest.py): one simulated step of
the common methods on each topology, so that the compiled (numba) kernels and torch's lazily built
paths are loaded once, in the server, instead of in every rank forked from it (about a second each).

On one torch thread (no thread pool exists to be forked), and with every global random state put
back: a forked rank starts as after a plain import.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def _warm() -> None:
    from dqsgd.data import load_dataset
    from dqsgd.method.config import method_config
    from dqsgd.train.config import MethodEntry, TrainConfig
    from dqsgd.train.trainer import Trainer

    data = load_dataset("synthetic")
    for topology in ("ps", "sharded"):
        cfg = TrainConfig(name="warm", dataset="synthetic", model="mlp", workers=2, steps=2, batch_size=8, lr=0.1,
                          eval_every=1000, threads=1, topology=topology)
        for method in ("dqsgd", "qsgd-4bit", "terngrad", "signsgd"):
            Trainer(cfg, MethodEntry(method, method_config(method)), data, 0).step()


_states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state(), torch.get_num_threads())
torch.set_num_threads(1)
try:
    _warm()
finally:
    random.setstate(_states[0])
    np.random.set_state(_states[1])
    torch.random.set_rng_state(_states[2])
    torch.set_num_threads(_states[3])
THREADS = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
