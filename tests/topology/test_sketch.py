"""Sketched SGD: the count sketch's heavy-hitter guarantee, exact bytes, error accumulation, configs."""

from __future__ import annotations

import pytest
import torch

import dqsgd
from dqsgd.codecs import decode
from dqsgd.codecs.sketch_wire import IndexKind, index_message_size
from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.quantizers.base import Scheme
from dqsgd.quantizers.sketch import DEFAULT_ROWS, CountSketch, top_indices
from dqsgd.topology.sketched import SketchedStep
from dqsgd.transport import SimTransport


def heavy_vector(d: int, heavy: torch.Tensor, magnitude: float, light_l1: float, gen: torch.Generator) -> torch.Tensor:
    """±magnitude on ``heavy``; elsewhere random values whose |·| sum to ``light_l1``."""
    x = torch.rand(d, generator=gen) * 2 - 1
    x[heavy] = 0.0
    x *= light_l1 / float(x.abs().sum())
    signs = torch.randint(0, 2, (heavy.numel(),), generator=gen).float() * 2 - 1
    x[heavy] = magnitude * signs
    return x


def guarantee_holds(cs: CountSketch, heavy: torch.Tensor) -> bool:
    """Every coordinate shares its bucket with another heavy coordinate in fewer than r/2 rows."""
    is_heavy = torch.zeros(cs.numel, dtype=torch.int64)
    is_heavy[heavy] = 1
    rows_hit = torch.zeros(cs.numel, dtype=torch.int64)
    for rho in range(cs.rows):
        per_bucket = torch.bincount(cs.flat[rho, heavy], minlength=cs.rows * cs.cols)
        rows_hit += (per_bucket[cs.flat[rho]] - is_heavy > 0).long()
    return bool((2 * rows_hit < cs.rows).all())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heavy_hitters_above_the_guarantee_are_recovered_exactly(seed: int) -> None:
    """min_H |x_i| > 2 · (light l1 mass) and the collision condition ⇒ top-k of the estimates is H."""
    d, k, cols = 2000, 6, 512
    gen = torch.Generator().manual_seed(seed)
    cs = CountSketch.draw(d, DEFAULT_ROWS, cols, gen)
    heavy = torch.sort(torch.randperm(d, generator=gen)[:k]).values
    x = heavy_vector(d, heavy, 1.0, 0.49, gen)
    assert guarantee_holds(cs, heavy)  # the premise, so the test is not vacuous
    assert torch.equal(top_indices(cs.estimate(cs.sketch(x)), k), heavy)


def test_linearity_and_sketched_step_recovers_exact_mean() -> None:
    """W workers whose sum has k heavy coordinates: the update is their exact mean there, 0 elsewhere."""
    W, d = 4, 2000
    cfg = method_config("sketched-sgd", topk_ratio=0.003, sketch_cols=80.0)  # k = 6, c = 480
    step = SketchedStep(Method(cfg, d, 10), seed=3, topology="ps", workers=W)
    gen = torch.Generator().manual_seed(5)
    heavy = torch.sort(torch.randperm(d, generator=gen)[: step.k]).values
    grads = {w: heavy_vector(d, heavy, 1.0, 0.1, gen) for w in range(W)}
    for w in range(W):  # the same heavy signs for every worker, so the sum keeps them heavy
        grads[w][heavy] = grads[0][heavy]
    total = sum(grads.values())
    assert torch.allclose(step.cs.sketch(total), sum(step.cs.sketch(g) for g in grads.values()), atol=1e-5)
    assert guarantee_holds(step.cs, heavy) and float(total[heavy].abs().min()) > 2 * float(
        total.index_fill(0, heavy, 0).abs().sum())
    state = step.method.init_state(W)
    r = step.run(SimTransport(W), grads, state, 0, {})
    acc = torch.zeros(heavy.numel())
    for w in range(W):  # worker order, float32: the server's sum
        acc = acc + grads[w][heavy]
    exact = acc / W
    assert torch.equal(torch.nonzero(r.update).reshape(-1), heavy)
    assert torch.equal(r.update[heavy], exact)


def run_steps(topology: str, steps: int = 3, W: int = 3, d: int = 900):
    cfg = method_config("sketched-sgd", topk_ratio=0.01)
    step = SketchedStep(Method(cfg, d, steps), seed=1, topology=topology, workers=W)
    state = step.method.init_state(W)
    t = SimTransport(W, topology)
    out = []
    for n in range(steps):
        grads = {w: torch.randn(d, generator=torch.Generator().manual_seed(100 * n + w)) for w in range(W)}
        old = list(state.residuals)
        r = step.run(t, grads, state, n, {}, measure_coded=True)
        out.append((grads, old, r))
        state = r.state
    return step, out, t


@pytest.mark.parametrize("topology", ["ps", "allgather", "sharded"])
def test_error_accumulation_invariant(topology: str) -> None:
    """u_w = ρ·u_w + g_w; sent_w + e_w(new) == u_w + e_w(old) bitwise; u_w and e_w are zero where sent;
    the update is the mean of what was sent."""
    step, out, t = run_steps(topology)
    assert t.steps == len(out)  # one completed step per step, although two rounds ran
    assert step.rho == 0.9
    for grads, old, r in out:
        chosen = torch.nonzero(r.update).reshape(-1)
        assert 0 < chosen.numel() <= step.k
        total = torch.zeros(chosen.numel())
        for w, g in grads.items():
            u = g if old[w] is None else 0.9 * old[w][0] + g
            a = u if old[w] is None else old[w][1] + u
            sent = torch.zeros_like(a)
            sent[chosen] = a[chosen]
            u_new, e_new = r.residuals[w]
            assert torch.equal(sent + e_new, a)
            assert torch.equal(u_new + torch.zeros_like(u).index_put((chosen,), u[chosen]), u)
            assert torch.equal(e_new[chosen], torch.zeros(chosen.numel()))
            total = total + a[chosen]
        assert torch.equal(r.update[chosen], total / len(grads))


def test_bytes_equal_the_predicted_sizes() -> None:
    step, out, _ = run_steps("ps")
    d, rows = step.method.numel, step.cs.rows
    sketch = 8 + 4 + 8 + 1 + 4 + 4 * rows * step.cols + 4  # header (2 dims, no scales), body, crc
    assert step.sketch_bytes() == sketch
    for _, _, r in out:
        assert r.uplink() == [sketch + step.values_bytes(step.m)] * 3
        assert r.coded == dict(enumerate(r.uplink()))
        assert r.down == [index_message_size(d, step.m, IndexKind.INDICES) + index_message_size(d, step.k,
                                                                                               IndexKind.SPARSE)]


def test_sharded_bytes_are_blocks_of_the_sketch() -> None:
    step, out, _ = run_steps("sharded")
    blocks = [step.sketch_bytes(hi - lo) for lo, hi in step.col_bounds]
    for _, _, r in out:
        cand_per_shard = [(b - step.values_bytes(0)) // 4 for b in (r.up[0][j] - blocks[j] for j in range(3))]
        assert sum(cand_per_shard) == step.m
        assert all(row == r.up[0] for row in r.up)
        assert r.down == [blk + step.values_bytes(c) for blk, c in zip(blocks, cand_per_shard)]


def test_topologies_give_the_same_update() -> None:
    updates = {topo: [r.update for _, _, r in run_steps(topo)[1]] for topo in ("ps", "allgather", "sharded")}
    for a, b, c in zip(*updates.values()):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_encode_api_sketches_a_tensor() -> None:
    x = torch.randn(100)
    payload = dqsgd.encode(x, scheme="sketch", bits=32, bucket=16, generator=torch.Generator().manual_seed(0))
    q = decode(payload)
    assert q.scheme == Scheme.SKETCH and q.shape == (DEFAULT_ROWS, 16)
    cs = CountSketch.draw(100, DEFAULT_ROWS, 16, torch.Generator().manual_seed(0))
    assert torch.equal(q.values.reshape(DEFAULT_ROWS, 16), cs.sketch(x))
    with pytest.raises(ValueError, match="column count"):
        dqsgd.encode(x, scheme="sketch", bits=32)


@pytest.mark.parametrize("opts, match", [
    (dict(topk_ratio=0.0), "topk_ratio"), (dict(sketch_rows=0), "sketch_rows"), (dict(sketch_p=0.5), "sketch_p"),
    (dict(error_feedback=True), "accumulates its own error"), (dict(bits=8), "bits must be 32"),
    (dict(policy="dqsgd"), "policy"), (dict(sketch_momentum=1.0), "sketch_momentum"),
])
def test_bad_sketch_configs_are_refused(opts: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        method_config("sketched-sgd", **opts)


def test_sharded_needs_a_column_per_shard() -> None:
    with pytest.raises(ValueError, match="columns among"):
        SketchedStep(Method(method_config("sketched-sgd", topk_ratio=0.001), 1000, 5), 0, "sharded", 8)


def test_one_message_pipeline_refuses_the_two_round_method() -> None:
    """Sketched SGD runs through SketchedStep (the trainer); Method.encode (the DDP hook's path) says so."""
    m = Method(method_config("sketched-sgd"), 100, 5)
    with pytest.raises(ValueError, match="two rounds"):
        m.encode(torch.ones(100), 32, torch.Generator())


def test_sketched_sgd_brings_its_own_optimizer_momentum() -> None:
    """Sketched SGD keeps its momentum on the workers: with [train] momentum = 0.9 and nothing set for the
    method, its optimizer runs without momentum (no refusal); an explicit second momentum is refused."""
    from dqsgd.data import load_dataset
    from dqsgd.train.config import MethodEntry, TrainConfig
    from dqsgd.train.trainer import Trainer

    cfg = TrainConfig(dataset="synthetic", model="mlp", workers=2, steps=2, momentum=0.9)
    data = load_dataset("synthetic")
    t = Trainer(cfg, MethodEntry("s", method_config("sketched-sgd")), data, 0)
    assert t.optimizer.param_groups[0]["momentum"] == 0.0
    with pytest.raises(ValueError, match="would add a second one"):
        Trainer(cfg, MethodEntry("s", method_config("sketched-sgd"), momentum=0.5), data, 0)
    Trainer(cfg, MethodEntry("s", method_config("sketched-sgd"), momentum=0.0), data, 0)
    no_sketch_momentum = method_config("sketched-sgd", sketch_momentum=0.0)
    assert MethodEntry("s", no_sketch_momentum).optimizer_momentum(cfg) == 0.9  # then the trainer's applies
    assert MethodEntry("q", method_config("qsgd")).optimizer_momentum(cfg) == 0.9


def test_cli_trains_sketched_sgd_with_the_defaults(tmp_path) -> None:
    """`dqsgd train --method sketched-sgd` with a config whose [train] momentum is 0.9 runs (it was refused)."""
    from dqsgd.cli.commands import main

    rc = main(["train", "--method", "sketched-sgd", "--quiet", "--out", str(tmp_path / "run"),
               "--set", "train.dataset=\"synthetic\"", "--set", "train.model=\"mlp\"", "--set", "train.steps=2",
               "--set", "train.workers=2", "--set", "train.eval_every=2", "--set", "train.momentum=0.9"])
    assert rc == 0 and (tmp_path / "run" / "summary.json").exists()
