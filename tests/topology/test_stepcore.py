"""The step core: one step object per topology, the trainer's state dict, the width beside the downlink."""

import json
from pathlib import Path

import pytest
import torch
from bucket_ref import aggregate, decode_downlink, downlink

from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method, MethodState
from dqsgd.quantizers import NonFiniteGradientError
from dqsgd.codecs import PayloadError
from dqsgd.topology.group import Turns, done
from dqsgd.topology.payloads import bytes_tensor, tensor_bytes
from dqsgd.topology.step import ExchangeStep, StepOutcome, all_finite, step_for
from dqsgd.train.checkpoint import load_checkpoint, save_checkpoint
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.runner import RunSummary, run_one
from dqsgd.train.trainer import Trainer
from dqsgd.transport import SimTransport

DATA = load_dataset("synthetic")
W, D = 3, 257


def cfg(**kw) -> TrainConfig:
    base = dict(name="t", dataset="synthetic", model="mlp", workers=W, steps=6, batch_size=16, lr=0.1,
                eval_every=6, seeds=(0,))
    return TrainConfig(**{**base, **kw})


def grads(seed: int = 3) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {w: torch.randn(D, generator=gen) * (w + 1) for w in range(W)}


class OtherRank(SimTransport):
    """Rank 1 of a ps step, without the server: its gather gives nothing, its broadcast the server's
    downlink message ``msg`` (here: built from a server step run beforehand)."""

    def __init__(self, msg: torch.Tensor):
        super().__init__(W, "ps")
        self.msg = msg

    def exchange_groups(self):  # type: ignore[no-untyped-def]
        return {1: _Rank1(self.msg)}


class _Rank1:
    rank, size, device = 1, W, torch.device("cpu")

    def __init__(self, msg: torch.Tensor):
        self.msg, self.turns = msg, Turns()

    def all_gather(self, t, leg):  # type: ignore[no-untyped-def]
        return done([t] * W)

    def gather(self, t, dst, leg):  # type: ignore[no-untyped-def]
        assert dst == 0
        return done(None)

    def broadcast(self, t, src, leg):  # type: ignore[no-untyped-def]
        assert src == 0 and t.numel() == self.msg.numel()
        return done(self.msg)

    def wait(self, fut):  # type: ignore[no-untyped-def]
        return fut.value()


def kept(sent: list[torch.Tensor]) -> type[SimTransport]:
    """A simulation whose ranks' uplink messages (payload, padding, flag byte) are kept in ``sent``."""

    class Keep(SimTransport):
        def exchange_groups(self):  # type: ignore[no-untyped-def]
            groups = super().exchange_groups()
            for g in groups.values():
                g.gather = lambda t, dst, leg, gather=g.gather: (sent.append(t), gather(t, dst, leg))[1]
            return groups

    return Keep


@pytest.mark.parametrize("name", ["dqsgd", "qsgd-4bit", "signsgd", "terngrad"])
def test_server_step_update_is_the_mean_of_the_decoded_payloads_and_the_policy_sees_it(name: str) -> None:
    method = Method(method_config(name), D, 10)
    state = method.init_state(W)
    step = step_for(method, "ps", [D], W, seed=5)
    msgs: list[torch.Tensor] = []
    gens = {w: torch.Generator().manual_seed(w) for w in range(W)}
    r = step.run(kept(msgs)(W, "ps"), grads(), state, 0, gens)
    assert [int(m[-1]) for m in msgs] == [0] * W  # every flag byte: finite, voting
    sent = [tensor_bytes(m[:n]) for m, (n,) in zip(msgs, r.up)]
    agg = aggregate(method, sent, state.bits)
    want = agg if method.config.downlink == "fp32" else decode_downlink(method, downlink(method, agg))
    assert torch.equal(r.update, want)
    assert r.down == [len(downlink(method, agg))]
    assert r.state is not None and r.state.policy is not None
    assert r.state == method.observe(MethodState(state.policy, [None] * W), agg, 0, 8 * max(map(len, sent)))
    assert r.side == (4 * method.local_scalers(grads()[0]).numel() if method.shares_scalers else 0)


def test_a_rank_without_the_policy_takes_the_servers_width_and_keeps_no_policy_state() -> None:
    """The width travels in the downlink message, after the payload: (payload, B_{n+1}, flag, status)."""
    method = Method(method_config("dqsgd"), D, 10)
    server = step_for(method, "ps", [D], W, 5).run(SimTransport(W, "ps"), grads(), method.init_state(W), 0,
                                                   {w: None for w in range(W)})
    assert server.state is not None
    down = bytes_tensor(downlink(method, server.update))
    msg = torch.cat([down, torch.tensor([server.state.bits + 1]).view(torch.uint8), torch.zeros(2, dtype=torch.uint8)])
    other = step_for(method, "ps", [D], W, 5).run(OtherRank(msg), {1: grads()[1]}, method.init_state(W), 0, {1: None})
    assert other.up == server.up  # the size table is every rank's
    assert other.state is not None and other.state.policy is None and other.state.bits == server.state.bits + 1
    assert torch.equal(other.update, server.update)
    with pytest.raises(ValueError, match="holds no policy state"):
        method.observe(other.state, other.update, 1, 8)
    msg[-1] = 1  # the server refused a payload: its text instead of the downlink
    msg[: len(b"PayloadError: worker 2: bad")] = bytes_tensor(b"PayloadError: worker 2: bad")
    with pytest.raises(PayloadError, match="rank 1: step 0: the server \\(rank 0\\) refused a payload: worker 2: bad"):
        step_for(method, "ps", [D], W, 5).run(OtherRank(msg), {1: grads()[1]}, method.init_state(W), 0, {1: None})


def test_method_state_width_rules() -> None:
    method = Method(method_config("qsgd-4bit"), D, 10)
    p = method.policy.init()
    assert MethodState(p, []).bits == 4
    assert MethodState(None, [], 6).bits == 6
    with pytest.raises(ValueError, match="needs its width"):
        MethodState(None, [])
    with pytest.raises(ValueError, match="width 3 given for a policy state of width 4"):
        MethodState(p, [], 3)


def test_every_topology_has_one_step_object_with_the_same_result_shape() -> None:
    for topology in ("ps", "allgather", "sharded"):
        tr = Trainer(cfg(topology=topology), MethodEntry("dqsgd", method_config("dqsgd")), DATA, 0)
        assert type(tr.step_runner) is ExchangeStep
        r = tr.step_runner.run(tr.transport, tr.local_gradients(0)[0], tr.state, 0, tr.qgen)
        assert isinstance(r, StepOutcome) and r.topology == topology and len(r.up) == W
        assert r.update.shape == (tr.numel,) and r.state is not None


def test_all_finite_skips_or_raises_naming_the_step() -> None:
    bad = {0: torch.ones(3), 1: torch.tensor([1.0, float("nan"), 0.0])}
    t = SimTransport(2)
    assert all_finite(t, {0: torch.ones(3)}, 0, "skip")
    assert not all_finite(t, bad, 4, "skip")
    assert all_finite(t, bad, 4, "raise")  # one process: the quantizer refuses it, naming the worker

    class Shared(SimTransport):
        @property
        def local_workers(self):  # type: ignore[no-untyped-def]
            return range(1)

    with pytest.raises(NonFiniteGradientError, match="step 4"):
        all_finite(Shared(2), bad, 4, "raise")


def test_state_dict_round_trip_continues_exactly() -> None:
    e = MethodEntry("dqsgd", method_config("dqsgd", error_feedback=True, kernel="torch"))
    full = Trainer(cfg(), e, DATA, 0)
    for _ in range(6):
        full.step()
    part = Trainer(cfg(), e, DATA, 0)
    for _ in range(3):
        part.step()
    sd = part.state_dict()
    assert sd["meta"] == part.run_meta() and sd["next_step"] == 3 and sd["bits"] == part.state.bits
    assert set(sd["residuals"]) == set(range(W))
    again = Trainer(cfg(), e, DATA, 0)
    again.load_state_dict(sd)
    assert again.transport.steps == 3
    for _ in range(3):
        again.step()
    assert torch.equal(again.flat_params(), full.flat_params())
    assert again.state.bits == full.state.bits
    with pytest.raises(ValueError, match="seed: 0 saved, 1 here"):
        Trainer(cfg(), e, DATA, 1).load_state_dict(sd)
    with pytest.raises(ValueError, match="format"):
        again.load_state_dict({**sd, "format": 1})


def test_a_state_saved_under_another_method_config_is_refused_naming_the_keys() -> None:
    """Same method name, 8 bits saved, 2 bits here: refused, naming method.bits (and nothing loads)."""
    saved = Trainer(cfg(), MethodEntry("q", method_config("qsgd", bits=8)), DATA, 0)
    saved.step()
    other = Trainer(cfg(), MethodEntry("q", method_config("qsgd", bits=2)), DATA, 0)
    before = other.flat_params().clone()
    with pytest.raises(ValueError, match=r"method.bits: 8 saved, 2 here"):
        other.load_state_dict(saved.state_dict())
    assert torch.equal(other.flat_params(), before) and other.next_step == 0


def test_a_checkpoint_without_policy_state_loads_as_the_width_alone(tmp_path: Path) -> None:
    """A ps rank other than the server writes ``policy: None`` and its ``bits`` (as files written
    before this layout did): it loads as a state holding only that width."""
    e = MethodEntry("dqsgd", method_config("dqsgd"))
    tr = Trainer(cfg(), e, DATA, 0)
    tr.step()
    sd = {**tr.state_dict(), "policy": None, "ledger": None, "bits": 7}
    torch.save(sd, tmp_path / "old.pt")  # no sha256: an unsealed file of the earlier writer
    other = Trainer(cfg(), e, DATA, 0)
    load_checkpoint(other, tmp_path / "old.pt")
    assert other.state.policy is None and other.state.bits == 7 and other.next_step == 1
    assert other.state_dict()["policy"] is None and other.state_dict()["bits"] == 7
    assert other.ledger.steps == 0  # no ledger in the file: this rank keeps none
    save_checkpoint(tr, tmp_path / "new.pt")
    load_checkpoint(other, tmp_path / "new.pt")
    assert other.state == tr.state and other.ledger.state_dict() == tr.ledger.state_dict()


def test_run_summary_keeps_the_tensor_out_of_json(tmp_path: Path) -> None:
    s = run_one(cfg(steps=2), MethodEntry("qsgd-4bit", method_config("qsgd-4bit")), DATA, 0, tmp_path, progress=False)
    assert isinstance(s, RunSummary) and "final_params" not in s
    assert torch.is_tensor(s["final_params"]) and s["final_params"] is s.final_params
    assert json.loads(json.dumps(s)) == json.loads((tmp_path / "summary.json").read_text())
    with pytest.raises(KeyError):
        s["no such key"]
