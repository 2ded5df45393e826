"""The asynchronous engine in simulation: every update applied exactly once under adversarial
reorderings, staleness never above τ, measured bytes = predicted, determinism, and AsyLPG < AsyFPG in bits."""

import dataclasses
import pytest

from dqsgd.codecs import predicted_size
from dqsgd.dq.algorithms import ALGORITHMS, RunConfig
from dqsgd.dq.engine import shard_sizes
from dqsgd.dq.sim import run_sim
from dqsgd.quantizers import Layout
from dq_helpers import check_exactly_once

BASE = RunConfig(algorithm="asylpg", workers=3, epochs=2, lr=0.1, eval_every=8, bandwidth_bps=0)

SCHEDULES = {
    "one very slow worker": [[50.0], [1.0], [1.0]],
    "alternating fast/slow": [[1.0, 9.0], [9.0, 1.0], [3.0, 5.0]],
    "reversed finishing": [[3.0, 2.0, 1.0], [2.0, 1.0, 3.0], [1.0, 3.0, 2.0]],
    "ties everywhere": [[1.0], [1.0], [1.0]],
    "zero and huge": [[0.0, 0.0, 100.0], [7.0], [0.0, 40.0]],
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_update_applied_exactly_once_under_adversarial_delays(problem, name) -> None:
    for tau in (1, 6):
        res = run_sim(problem, dataclasses.replace(BASE, tau=tau), schedule=SCHEDULES[name])
        check_exactly_once(res)
        assert all(r.staleness <= tau for r in res.messages if r.applied)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_every_algorithm_keeps_the_protocol_invariants(problem, algorithm) -> None:
    cfg = dataclasses.replace(BASE, algorithm=algorithm, workers=4, delay="lognormal", delay_sigma=1.0,
                              bandwidth_bps=1e6)
    res = run_sim(problem, cfg)
    check_exactly_once(res)
    assert res.evals[-1].loss < res.evals[0].loss
    assert all(r.staleness <= cfg.staleness_bound for r in res.messages if r.applied)


def test_staleness_never_exceeds_tau_with_heavy_tailed_delays(problem) -> None:
    cfg = dataclasses.replace(BASE, workers=4, tau=3, epochs=3, delay="lognormal", delay_sigma=2.0)
    res = run_sim(problem, cfg)
    grads = [r for r in res.messages if r.kind == "grad"]
    assert sum(res.staleness.values()) == len(grads)          # the histogram covers every arrival
    assert max(res.staleness) > cfg.tau                        # heavy tails do produce stale arrivals …
    assert all(r.staleness <= cfg.tau for r in grads if r.applied)  # … and none of them is applied
    rejected = [r for r in grads if not r.applied]
    assert rejected and all(r.down_bits_x >= 0 and r.down_bytes > 9 for r in rejected)  # refetch: a MODEL reply
    check_exactly_once(res)


def test_measured_bytes_match_the_predicted_message_sizes(problem) -> None:
    cfg = dataclasses.replace(BASE, algorithm="asyfpg", epochs=2)
    res = run_sim(problem, cfg)
    fp32 = predicted_size(problem.d, 32, 0, 1, Layout(), )
    up, down = 15 + fp32, 9 + fp32                              # envelopes + codec payload
    assert all(r.up_bytes == up for r in res.messages)
    assert res.sync_bytes == cfg.epochs * cfg.workers * (up + 2 * down)   # x̃ down, ∇f_w up, ∇f down
    lp = dataclasses.replace(BASE, algorithm="qsvrg", grad_bits=4)
    lp_res = run_sim(problem, lp)
    lp_up = 15 + predicted_size(problem.d, 4, 1, 1, Layout())
    assert all(r.up_bytes == lp_up for r in lp_res.messages if r.kind == "grad")
    n_w = shard_sizes(problem.n, 3)
    assert sum(n_w) == problem.n
    # the inner ledger holds every inner message: replies, start-of-epoch models, STOPs
    assert res.inner_up_bytes == sum(r.up_bytes for r in res.messages if r.kind == "grad")


def test_simulation_is_deterministic_and_seeded(problem) -> None:
    cfg = dataclasses.replace(BASE, workers=4, delay="exp", bandwidth_bps=1e7)
    a, b = run_sim(problem, cfg), run_sim(problem, cfg)
    assert a.order == b.order and a.bits == b.bits and a.x_crc == b.x_crc
    c = run_sim(problem, dataclasses.replace(cfg, seed=1))
    assert c.x_crc != a.x_crc


def test_asylpg_beats_asyfpg_start_with_fewer_bits_per_update(problem) -> None:
    cfg = dataclasses.replace(BASE, workers=4, epochs=50, max_updates=96, delay="exp", bandwidth_bps=1e8)
    lpg = run_sim(problem, cfg)
    fpg = run_sim(problem, dataclasses.replace(cfg, algorithm="asyfpg"))
    assert lpg.updates == fpg.updates == 96
    assert lpg.evals[-1].loss < fpg.evals[0].loss
    assert lpg.bits < fpg.bits / 2 and lpg.sync_bytes == fpg.sync_bytes


def test_stop_at_target_drains_in_flight_work(problem) -> None:
    cfg = dataclasses.replace(BASE, workers=4, epochs=20, target=0.5, eval_every=4)
    res = run_sim(problem, cfg)
    assert res.reached is not None and res.reached.loss < 0.5
    assert res.updates >= res.reached.updates and res.updates <= res.reached.updates + cfg.workers
    check_exactly_once(res)


def test_acc_sends_the_query_point_in_its_precision(problem) -> None:
    cfg = dataclasses.replace(BASE, algorithm="acc-asyfpg", theta=0.0)
    assert cfg.theta_at(0) == 0.5 and cfg.theta_at(6) == 0.2   # θ_s = 2/(s+4) [OC]
    res = run_sim(problem, cfg)
    assert set(res.bx) <= {0, 32} and res.bx[32] > 0           # fp32 both ways; flags only when y = x̃
    lp = run_sim(problem, dataclasses.replace(cfg, algorithm="acc-asylpg"))
    assert all(0 < b <= 16 for b in lp.bx if b not in (0, 32)) and lp.bits < res.bits
    check_exactly_once(res)
    check_exactly_once(lp)


def test_master_refuses_out_of_protocol_messages(problem) -> None:
    """Duplicates, gradients nobody asked for, forged worker ids, wrong epochs: ProtocolError."""
    from dqsgd.dq.engine import Master, Worker
    from dqsgd.dq.messages import Up, UpKind, pack_up
    from dqsgd.method.pipeline import ProtocolError

    cfg = dataclasses.replace(BASE, workers=2)
    master = Master(problem, cfg)
    shards = problem.shards(2, __import__("torch").Generator().manual_seed(0))
    workers = [Worker(w, problem, cfg, shards[w]) for w in range(2)]
    sync = dict(master.start())
    full0 = workers[0].handle(sync[0])
    with pytest.raises(ProtocolError):
        master.handle(1, full0)                      # worker 0's message arriving as worker 1's
    master.handle(0, full0)
    with pytest.raises(ProtocolError):
        master.handle(0, full0)                      # duplicate (worker, seq)
    with pytest.raises(ProtocolError):               # a gradient before the epoch's models went out
        master.handle(1, pack_up(Up(UpKind.GRAD, 1, 5, 0, 0, b"")))
    replies = master.handle(1, workers[1].handle(sync[1]))
    with pytest.raises(ProtocolError):               # a second full gradient in the inner loop
        master.handle(1, pack_up(Up(UpKind.FULLGRAD, 1, 9, 0, 0, b"")))
    with pytest.raises(ProtocolError):               # wrong epoch
        master.handle(0, pack_up(Up(UpKind.GRAD, 0, 7, 3, 0, b"")))
    for w, data in replies:
        assert workers[w].handle(data) is None or data[0] == 3  # SYNC_G then MODEL (kind 3)


def test_each_generator_is_its_own_rng_stream(problem) -> None:
    """Master, per-worker sampling and quantization come from dqsgd.core.rng streams 6-8, all distinct."""
    import torch

    from dqsgd.core import rng
    from dqsgd.dq.engine import Master, Worker

    cfg = dataclasses.replace(BASE, workers=2, seed=5)
    shards = problem.shards(2, rng.generator(cfg.seed, rng.DQ_SHARD))
    master, workers = Master(problem, cfg), [Worker(w, problem, cfg, shards[w]) for w in range(2)]
    states = {"master": master.gen.get_state()}
    for w in workers:
        assert torch.equal(w.g_sample.get_state(), rng.generator(5, rng.DQ_SAMPLE, w.wid).get_state())
        assert torch.equal(w.g_quant.get_state(), rng.generator(5, rng.DQ_QUANT, w.wid).get_state())
        states |= {f"sample{w.wid}": w.g_sample.get_state(), f"quant{w.wid}": w.g_quant.get_state()}
    assert torch.equal(states["master"], rng.generator(5, rng.DQ_MASTER).get_state())
    firsts = {k: torch.Generator().set_state(s).initial_seed() for k, s in states.items()}
    assert len(set(firsts.values())) == len(firsts)  # no two roles or workers share a generator
    streams = [rng.DATA_SHARDS, rng.DATA_EPOCH, rng.QUANT, rng.MODEL_INIT, rng.DOWNLINK,
               rng.DQ_MASTER, rng.DQ_SAMPLE, rng.DQ_QUANT, rng.DQ_DELAY, rng.DQ_SHARD]
    assert sorted(streams) == list(range(1, 11))
