"""Local SGD in the trainer (dqsgd.train.local): H = 1 is the per-step trainer bitwise, rounds exchange
pseudo-gradients only at their ends, the outer optimizers are the formulas, budgets over rounds are never
overspent, a run resumes exactly mid-round, and the config keys are checked."""

import dataclasses
import io

import pytest
import torch
from synthetic_runs import entry, train_config

from dqsgd.data import load_dataset
from dqsgd.train.config import ConfigError, TrainConfig, build_experiment
from dqsgd.train.local import Period
from dqsgd.train.trainer import Trainer
from dqsgd.transport import SimTransport

DATA = load_dataset("synthetic")


def trainer(topology: str = "sharded", method: str = "qsgd-4bit", seed: int = 0, **kw) -> Trainer:
    cfg = train_config(**{"topology": topology, "momentum": 0.9, **kw})
    return Trainer(cfg, entry(method), DATA, seed, SimTransport(cfg.workers, topology))


def run(tr: Trainer) -> list:
    return [tr.step() for _ in range(tr.cfg.steps - tr.next_step)]


def per_step_reference(tr: Trainer) -> torch.Tensor:
    """The per-step algorithm written out: every worker's gradient, the step object, SGD on the average."""
    state = tr.state
    for n in range(tr.cfg.steps):
        grads = {w: tr.worker_gradient(w, n)[0] for w in range(tr.cfg.workers)}
        ex = tr.step_runner.run(tr.transport, grads, state, n, tr.qgen)
        state = ex.state
        tr.apply_update(ex.update, tr.lr_at(n))
    return tr.flat_params()


@pytest.mark.parametrize("topology,method", [("sharded", "qsgd-4bit"), ("sharded", "dqsgd"), ("ps", "dqsgd")])
def test_h1_with_outer_sgd_lr1_is_the_per_step_trainer_bitwise(topology: str, method: str) -> None:
    kw = dict(local_steps=1, outer_optimizer="sgd", outer_lr=1.0, lr_schedule="cosine")
    tr = trainer(topology, method, **kw)
    assert tr.local is None  # H = 1 with plain averaging: the per-step exchange of gradients
    results = run(tr)
    assert all(r.up_bytes for r in results)  # an exchange every step
    assert torch.equal(tr.flat_params(), per_step_reference(trainer(topology, method, **kw)))
    default = trainer(topology, method, lr_schedule="cosine")
    run(default)
    assert torch.equal(tr.flat_params(), default.flat_params())
    assert [r.bits for r in tr.ledger.records] == [r.bits for r in default.ledger.records]


def test_rounds_exchange_only_at_their_ends_and_the_model_moves_only_then() -> None:
    tr = trainer(local_steps=8, steps=20)
    assert tr.method.total_steps == 3  # the policy counts rounds: ceil(20 / 8)
    exchanged = []
    for _ in range(20):
        before = tr.flat_params()
        r = tr.step()
        if r.up_bytes:
            exchanged.append(r.step)
        else:
            assert torch.equal(before, tr.flat_params())  # the synchronized model waits for the round's end
            assert r.down_bytes == 0 and r.encode_s == 0.0
    assert exchanged == [7, 15, 19] and [rec.step for rec in tr.ledger.records] == exchanged


def capture_deltas(tr: Trainer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(θ_r, mean Δ_w) of every round, in float64, as the trainer hands them to the exchange."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    communicate = tr.communicate

    def spy(vectors, *args, **kw):  # type: ignore[no-untyped-def]
        mean = torch.stack([v.double() for v in vectors.values()]).mean(0)
        seen.append((tr.flat_params().double(), mean))
        return communicate(vectors, *args, **kw)

    tr.communicate = spy  # type: ignore[method-assign]
    return seen


def test_outer_sgd_lr1_is_model_averaging() -> None:
    # fp32 pseudo-gradients, fp32 downlink: θ_{r+1} = θ_r − mean Δ_w = mean θ_w
    tr = trainer("ps", "sgd", local_steps=4, steps=12)
    seen = capture_deltas(tr)
    after = []
    for _ in range(12):
        if tr.step().up_bytes:
            after.append(tr.flat_params().double())
    assert len(seen) == 3
    for (start, delta), got in zip(seen, after):
        assert torch.allclose(got, start - delta, atol=1e-6, rtol=0)
        assert not torch.allclose(got, start, atol=1e-6)  # the workers did move it


def test_outer_nesterov_is_momentum_on_the_averaged_pseudo_gradient() -> None:
    lr, mu = 0.7, 0.9
    tr = trainer("ps", "sgd", local_steps=3, steps=9, outer_optimizer="nesterov", outer_lr=lr, outer_momentum=mu)
    seen = capture_deltas(tr)
    after = []
    for _ in range(9):
        if tr.step().up_bytes:
            after.append(tr.flat_params().double())
    m = torch.zeros_like(seen[0][1])
    for (start, delta), got in zip(seen, after):
        m = mu * m + delta
        assert torch.allclose(got, start - lr * (delta + mu * m), atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("method,topology", [("dqsgd", "sharded"), ("dqsgd", "ps"), ("dqsgd-coded", "sharded"),
                                             ("dqsgd-coded", "ps")])
def test_budget_over_rounds_is_never_overspent(method: str, topology: str) -> None:
    """Budgeted DQSGD with H = 4: the budget of nominal bits (dqsgd) or entropy-coded bits (dqsgd-coded)
    is planned over the rounds, checked after every exchange, and nearly spent by the last."""
    tr = trainer(topology, method, local_steps=4, steps=80)
    assert tr.method.total_steps == 20
    budget = tr.ledger.budget_bits
    assert budget == tr.policy.budget_bits and budget > 0
    for _ in range(80):
        tr.step()
        assert tr.ledger.spent_bits() <= budget, f"overspent at step {tr.next_step - 1}"
    assert len(tr.ledger.records) == 20
    # Coded sizes above the width last sent are planned from an upper estimate: a little is left unspent.
    assert tr.ledger.spent_bits() >= (0.95 if method == "dqsgd" else 0.9) * budget, tr.ledger.spent_bits() / budget
    assert len({r.bits for r in tr.ledger.records}) > 1  # the width follows the rounds' norms


@pytest.mark.parametrize("kw", [
    dict(method="dqsgd", local_steps=4, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9),
    dict(method="ef-signsgd", local_steps=3, inner_optimizer="adamw", lr=0.003, weight_decay=0.01),
    dict(method="qsgd-4bit", local_steps=6, local_period="adaptive", local_steps_min=2, partition="dirichlet",
         dirichlet_alpha=0.3),
])
def test_resume_mid_round_is_exact(kw: dict) -> None:
    kw = {"steps": 14, **kw}
    full = trainer(**kw)
    run(full)
    part = trainer(**kw)
    for _ in range(5):  # stops inside a round
        part.step()
    buf = io.BytesIO()
    torch.save(part.state_dict(), buf)
    buf.seek(0)
    resumed = trainer(**kw)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    run(resumed)
    assert torch.equal(full.flat_params(), resumed.flat_params())
    assert [(r.step, r.bits, r.up_bytes) for r in full.ledger.records] == \
        [(r.step, r.bits, r.up_bytes) for r in resumed.ledger.records]
    if kw["method"] == "ef-signsgd":
        assert any(r is not None and bool(r.abs().sum() > 0) for r in full.state.residuals)  # error feedback ran


def test_adaptive_period_shrinks_with_the_loss_and_stays_in_range() -> None:
    p = Period(dataclasses.replace(train_config(), local_steps=16, local_steps_min=2, local_period="adaptive"))
    assert p.next(2.0) == 16           # the first round sets L_0
    assert p.next(0.5) == 8            # ceil(16 * sqrt(1/4))
    assert p.next(0.0) == 2            # never below local_steps_min
    assert p.next(8.0) == 16           # never above local_steps
    assert p.next(float("nan")) == 16  # no finite loss: the initial period
    tr = trainer(local_steps=8, local_steps_min=2, local_period="adaptive", steps=60, lr=0.2)
    run(tr)
    gaps = [b - a for a, b in zip([-1] + [r.step for r in tr.ledger.records], [r.step for r in tr.ledger.records])]
    assert gaps[0] == 8 and min(gaps[:-1]) >= 2 and gaps[-2] < 8, gaps  # the loss fell: shorter rounds
    assert tr.method.total_steps == 30  # a budget is planned for the most rounds: ceil(60 / 2)


def test_config_keys_are_checked() -> None:
    for kw, msg in [(dict(local_steps=0), "local_steps must be >= 1"),
                    (dict(outer_optimizer="adam"), "outer_optimizer must be"),
                    (dict(outer_optimizer="nesterov"), "needs outer_momentum > 0"),
                    (dict(local_steps=4, vmap_workers=True), "vmap_workers"),
                    (dict(local_steps=4, local_steps_min=5), "local_steps_min"),
                    (dict(partition="skewed"), "partition must be"),
                    (dict(dirichlet_alpha=0.0), "dirichlet_alpha")]:
        with pytest.raises(ConfigError, match=msg):
            TrainConfig(**kw)
    exp = build_experiment({"train": {"steps": 100}, "methods": {
        "h8": {"method": "qsgd-4bit", "local_steps": 8, "outer_lr": 1}, "sgd": {}}})
    h8, sgd = exp.methods
    assert h8.train_config(exp.train).local_steps == 8 and h8.train_config(exp.train).rounds == 13
    assert sgd.train_config(exp.train) is exp.train
    with pytest.raises(ConfigError, match="methods.h8.local_steps must be int"):
        build_experiment({"methods": {"h8": {"local_steps": "8"}}})
    with pytest.raises(ConfigError, match="methods.bad: train: outer_optimizer 'nesterov' needs"):
        build_experiment({"methods": {"bad": {"method": "sgd", "outer_optimizer": "nesterov"}}})
    with pytest.raises(ConfigError, match="allowed: method, lr, momentum, local_steps"):
        build_experiment({"methods": {"sgd": {"local_step": 8}}})


def test_a_model_with_batchnorm_statistics_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    d = DATA.train.x[0].numel()
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(d, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 10))
    monkeypatch.setattr("dqsgd.train.trainer.build_model", lambda name, data: net)
    with pytest.raises(ValueError, match="has buffers"):
        trainer(local_steps=4)
