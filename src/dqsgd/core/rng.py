"""Seed streams: every random draw of a run is a pure function of (seed, stream, ...).

Common random numbers: for a given seed every method sees the same initial model and the same
minibatch sequence, because data, quantization and model initialization draw from separate
streams. The simulation, the torch.distributed transports and the DDP hook all take their seeds
from here, so they draw the same numbers.

Streams: 1 — the global shard permutation of the training set; 2 — worker w's order in epoch e;
3 — worker w's uplink quantization (a ``torch.Generator`` for the torch kernel, the key of the
counter-based hash uniforms for the fused kernel); 4 — model initialization; 5 — the sharded
topology's downlink rounding.

The Double Quantization engine (``dqsgd.dq``) draws from streams 6–10, one generator each, never
shared between processes: 6 — the master's model quantization (``seed_for(seed, DQ_MASTER)``);
7 — worker w's minibatch indices (``seed_for(seed, DQ_SAMPLE, w)``); 8 — worker w's gradient
quantization (``seed_for(seed, DQ_QUANT, w)``); 9 — the simulation's delays
(``seed_for(seed, DQ_DELAY)``); 10 — the split of the training set into worker shards
(``seed_for(seed, DQ_SHARD)``).

11 — Sketched SGD's count-sketch hashes, drawn once per run and the same on every process
(``generator(seed, SKETCH)``); 12 — the slow-node model's per-worker compute times
(``seed_for(seed, COMPUTE_TIME)``, :mod:`dqsgd.train.slownodes`); 13 — the label-skewed
(Dirichlet) split of the training set into worker shards (``train.partition = "dirichlet"``).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["COMPUTE_TIME", "DATA_EPOCH", "DATA_PARTITION", "DATA_SHARDS", "DOWNLINK", "DQ_DELAY", "DQ_MASTER", "DQ_QUANT",
           "DQ_SAMPLE", "DQ_SHARD", "MODEL_INIT", "QUANT", "SKETCH", "generator", "seed_for"]

DATA_SHARDS, DATA_EPOCH, QUANT, MODEL_INIT, DOWNLINK = 1, 2, 3, 4, 5
DQ_MASTER, DQ_SAMPLE, DQ_QUANT, DQ_DELAY, DQ_SHARD = 6, 7, 8, 9, 10
SKETCH, COMPUTE_TIME, DATA_PARTITION = 11, 12, 13


def seed_for(*parts: int) -> int:
    """A 63-bit seed mixed from integers (numpy's SeedSequence: well-spread, deterministic)."""
    state = np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def generator(*parts: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed_for(*parts)``."""
    return torch.Generator().manual_seed(seed_for(*parts))
