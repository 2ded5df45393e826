"""The real asynchronous run: 1 master + 2 gloo worker processes on 127.0.0.1 (one spawn, five jobs).

* Ordered jobs replay a simulation's arrival order (the master receives from the worker the
  simulation says is next). Master and workers are deterministic given the order, so the real run
  must reproduce the simulation message for message: same per-message bytes, same total bits
  (inner and epoch-sync), same final model (CRC-32 of its float32 bytes). Checked for AsyLPG,
  Sparse-AsyLPG (variable-size messages) and Acc-AsyLPG.
* Free jobs take messages in whatever order they complete (``irecv`` from any source): the
  trajectory then differs from any simulation, so we check the invariants — every message each
  worker sent was handled exactly once, m updates per epoch, staleness ≤ τ — and, for AsyFPG with
  τ large enough that nothing is rejected, that the multiset of per-message sizes (fixed for fp32)
  equals the simulation's, hence the same total bits.
"""

import dataclasses
from collections import Counter

import pytest

from dqsgd.dq.algorithms import RunConfig
from dqsgd.dq.dist import run_dist_jobs
from dqsgd.dq.sim import run_sim

from dq_helpers import SPEC, check_exactly_once

pytestmark = pytest.mark.distributed

BASE = RunConfig(algorithm="asylpg", workers=2, epochs=2, lr=0.1, eval_every=16, bandwidth_bps=0, timeout_s=60)
SCHEDULE = [[1.0, 0.3, 2.5, 0.2], [0.7, 1.9, 0.1]]


def _fields(r):
    return (r.worker, r.seq, r.kind, r.epoch, r.version, r.staleness, r.applied, r.up_bytes, r.down_bytes, r.down_bits_x)


def test_real_gloo_runs_agree_with_the_simulation(problem) -> None:
    ordered = [dataclasses.replace(BASE, algorithm=a, tau=2) for a in ("asylpg", "sparse-asylpg", "acc-asylpg")]
    sims = [run_sim(problem, cfg, schedule=SCHEDULE) for cfg in ordered]
    assert any(not r.applied for r in sims[0].messages)  # the schedule exercises the stale path too
    free_lpg = dataclasses.replace(BASE, tau=2)
    free_fpg = dataclasses.replace(BASE, algorithm="asyfpg", tau=1000)
    jobs = [(cfg, sim.order) for cfg, sim in zip(ordered, sims)] + [(free_lpg, None), (free_fpg, None)]
    real = run_dist_jobs(SPEC, jobs)

    for sim, got in zip(sims, real[:3]):
        assert [_fields(r) for r in got.messages] == [_fields(r) for r in sim.messages]
        assert (got.bits, got.sync_bytes, got.updates) == (sim.bits, sim.sync_bytes, sim.updates)
        assert got.x_crc == sim.x_crc
        assert [e.loss for e in got.evals] == [e.loss for e in sim.evals]
        check_exactly_once(got)

    for got in real[3:]:
        check_exactly_once(got)
        assert all(r.staleness <= got.cfg.staleness_bound for r in got.messages if r.applied)
    fpg_sim = run_sim(problem, free_fpg)
    sizes = lambda res: Counter((r.kind, r.up_bytes, r.down_bytes) for r in res.messages)  # noqa: E731
    assert sizes(real[4]) == sizes(fpg_sim) and real[4].bits == fpg_sim.bits
