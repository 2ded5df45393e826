"""Sparse pseudo-gradients (top-k / random-k with quantized values) in Local SGD: the wire (measured bytes ==
predicted bytes, exact round trips, refusals), random-k's unbiasedness as a Monte-Carlo statistic, top-k's
error feedback (telescoping identity, bounded residual against a linearly growing error without it), the
byte budget that picks each round's width and density, and the trainer's rounds (exact resume, budget)."""

import io
import math

import pytest
import torch
from synthetic_runs import entry, train_config

from dqsgd.codecs import PayloadError, decode, encode
from dqsgd.codecs.sparse_wire import decode_sparse, encode_sparse, sparse_message_size
from dqsgd.core.rng import QUANT, generator
from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.policies.base import GradStats
from dqsgd.policies.sparse_budget import SparseBudget, budget_policy, message_cost
from dqsgd.quantizers import Scheme, dequantize, quantize_identity
from dqsgd.quantizers.sparse import density_count, quantize_values, select
from dqsgd.topology.sparse import SparseStep
from dqsgd.train.trainer import Trainer
from dqsgd.transport import SimTransport

DATA = load_dataset("synthetic")
EPS = torch.finfo(torch.float32).eps


# --- the wire ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d,k,bits", [(1, 1, 2), (1000, 0, 4), (1000, 1, 2), (1000, 10, 2), (1000, 333, 5),
                                      (70000, 700, 3), (257, 257, 16), (300, 30, 32)])
def test_measured_bytes_equal_predicted_and_the_round_trip_is_exact(d: int, k: int, bits: int) -> None:
    g = torch.Generator().manual_seed(d + k + bits)
    idx, vals = select(torch.randn(d, generator=g), k, "randk", g)
    q = quantize_identity(vals) if bits == 32 else quantize_values(vals, bits, g)
    msg = encode_sparse(idx, d, q)
    assert len(msg) == sparse_message_size(d, k, bits)
    got_idx, got = decode_sparse(msg, d, k, Scheme.IDENTITY if bits == 32 else Scheme.UNIFORM, bits)
    assert torch.equal(got_idx, idx)
    if k == 0:
        assert got is None
        return
    assert torch.equal(dequantize(got), dequantize(q)) and torch.equal(got.codes, q.codes)
    assert encode_sparse(got_idx, d, got) == msg  # a decoded message re-encodes to the same bytes


def test_malformed_messages_are_refused() -> None:
    g = torch.Generator().manual_seed(1)
    idx, vals = select(torch.randn(500, generator=g), 20, "topk", None)
    msg = encode_sparse(idx, 500, quantize_values(vals, 3, g))
    for bad, why in [(msg[:-1], "crc|truncat|length|bytes"), (msg + b"\0", "bytes|length|trailing"),
                     (msg[:11], "truncated")]:
        with pytest.raises(PayloadError, match=why):
            decode_sparse(bad, 500, 20, Scheme.UNIFORM, 3)
    with pytest.raises(PayloadError, match="at 4 bits|3 bits"):
        decode_sparse(msg, 500, 20, Scheme.UNIFORM, 4)  # another width than the round's
    with pytest.raises(PayloadError, match="at most 19"):
        decode_sparse(msg, 500, 19, Scheme.UNIFORM, 3)  # more coordinates than the receiver accepts
    with pytest.raises(PayloadError, match="d = 500"):
        decode_sparse(msg, 501, 20, Scheme.UNIFORM, 3)
    empty = encode_sparse(torch.zeros(0, dtype=torch.int64), 500, quantize_values(torch.zeros(0), 3, g))
    with pytest.raises(PayloadError, match="no coordinates"):
        decode_sparse(empty + encode(quantize_values(vals, 3, g)), 500, 20, Scheme.UNIFORM, 3)
    assert decode(encode(quantize_values(vals, 3, g))).numel == 20  # (the values part alone is a project payload)


# --- the sparsifiers ----------------------------------------------------------------------------------------------
def test_topk_keeps_the_largest_magnitudes_lower_index_first_on_ties() -> None:
    p = torch.tensor([0.5, -3.0, 1.0, 3.0, -1.0, 0.0])
    idx, vals = select(p, 3, "topk", None)
    assert idx.tolist() == [1, 2, 3] and vals.tolist() == [-3.0, 1.0, 3.0]  # |1.0| at 2 before |-1.0| at 4
    assert density_count(6, 0.01) == 1 and density_count(6, 1.0) == 6 and density_count(0, 0.5) == 0


def test_randk_scaled_by_d_over_k_is_unbiased_monte_carlo() -> None:
    """N draws of x̂ = Q_b((d/k)·p_S) on S: each coordinate's sample mean is within 5 standard errors of p_i,
    the standard error from the variance bound Var x̂_i ≤ (d/k)·p_i² + (d/k)·((d/k)‖p‖∞)²/(4s²) − p_i²
    (P(i ∈ S) = k/d; kept, the value (d/k)p_i rounds at a scale ≤ (d/k)‖p‖∞ with variance ≤ scale²/(4s²))."""
    d, k, bits, n = 40, 8, 3, 20000
    p = torch.randn(d, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    g = torch.Generator().manual_seed(4)
    total = torch.zeros(d, dtype=torch.float64)
    for _ in range(n):
        idx, vals = select(p, k, "randk", g)
        total[idx] += dequantize(quantize_values(vals, bits, g)).double()
    mean, pd = total / n, p.double()
    s, r = (1 << (bits - 1)) - 1, d / k
    var = r * pd ** 2 + r * (r * pd.abs().max()) ** 2 / (4 * s * s) - pd ** 2
    z = (mean - pd).abs() / (var / n).sqrt()
    assert float(z.max()) < 5.0, float(z.max())
    # top-k is not: a coordinate outside the top k is never sent
    idx, _ = select(p, k, "topk", None)
    assert idx.numel() == k and all(float(p.abs()[i]) >= float(p.abs().sort().values[-k]) for i in idx)


def ef_rounds(deltas: list[torch.Tensor], k: int, bits: int, ef: bool) -> tuple[list[torch.Tensor], list]:
    """One worker's rounds of top-k through SparseStep (W = 1, ps: the applied update is its decoded message)."""
    d = deltas[0].numel()
    m = Method(method_config("topk", topk_ratio=k / d, bits=bits, error_feedback=ef), d, len(deltas), [d])
    step = SparseStep(m, "ps", 1, 0, 32)
    state, gens = m.init_state(1, step.policy), {0: generator(0, QUANT, 0)}
    sent, residuals = [], []
    t = SimTransport(1, "ps")
    for r, delta in enumerate(deltas):
        ex = step.run(t, {0: delta}, state, r, gens)
        state = ex.state
        sent.append(ex.update)
        residuals.append(state.residuals[0])
    return sent, residuals


def test_topk_error_feedback_telescopes_and_its_residual_stays_bounded() -> None:
    """With feedback Σ_r x̂_r = Σ_r Δ_r − e_R (the cumulative error is the last residual), and each round
    ‖x̂ − p‖ ≤ c‖p‖ with c = √(1 − k/d) + √k/s (the dropped coordinates, and one level of rounding per kept
    value at scale ‖p‖∞), so ‖e_r‖ ≤ c/(1 − c)·max‖Δ‖ for every r (c < 1 at b = 10)."""
    d, k, bits, rounds = 200, 20, 10, 300
    g = torch.Generator().manual_seed(5)
    deltas = [torch.randn(d, generator=g) * (1 + (r % 7)) for r in range(rounds)]
    sent, residuals = ef_rounds(deltas, k, bits, ef=True)
    total = torch.stack(deltas).double().sum(0)
    applied = torch.stack(sent).double().sum(0)
    scale = torch.stack(deltas).double().abs().sum(0) + torch.stack(residuals).double().abs().sum(0)
    assert torch.all((applied - (total - residuals[-1].double())).abs() <= 4 * EPS * scale)
    c = math.sqrt(1 - k / d) + math.sqrt(k) / ((1 << (bits - 1)) - 1)
    bound = c / (1 - c) * max(float(x.norm()) for x in deltas)
    assert max(float(e.norm()) for e in residuals) <= bound * (1 + 1e-4)


def test_without_feedback_a_constant_delta_loses_its_tail_every_round_with_it_the_error_stays_put() -> None:
    d, k, rounds = 100, 10, 60
    delta = torch.linspace(1.0, 2.0, d)
    sent, _ = ef_rounds([delta] * rounds, k, 16, ef=False)
    sent_ef, residuals = ef_rounds([delta] * rounds, k, 16, ef=True)
    err = [float((torch.stack(sent[: r + 1]).double().sum(0) - (r + 1) * delta.double()).norm()) for r in range(rounds)]
    err_ef = [float((torch.stack(sent_ef[: r + 1]).double().sum(0) - (r + 1) * delta.double()).norm())
              for r in range(rounds)]
    assert err[-1] >= 0.99 * rounds * err[0]  # the same 90 coordinates dropped every round: linear growth
    assert max(err_ef[rounds // 2:]) <= 1.01 * max(err_ef[: rounds // 2])  # bounded: no growth after the start
    assert err_ef[-1] == pytest.approx(float(residuals[-1].double().norm()), rel=1e-5)


# --- the budget: width and density ---------------------------------------------------------------------------------
def test_budget_policy_prices_exactly_and_picks_bits_for_concentrated_mass_coordinates_for_spread_mass() -> None:
    d, rounds = 5000, 10
    pol = budget_policy(method_config("topk-budget", target_bits=0.3), d, rounds)
    st = pol.init()
    assert st.bits == 2 and pol.cost(st.count, 2) <= st.allowance < pol.cost(st.count + 1, 2)
    assert all(message_cost(d, 1)(k, b) == 8 * sparse_message_size(d, k, b) for k in (1, 7, 99) for b in (2, 5, 8))
    spiky = torch.zeros(d)
    spiky[:5] = torch.tensor([10.0, -9.0, 8.0, 7.5, -7.0])
    spiky[5:] = 1e-3
    spread = torch.randn(d, generator=torch.Generator().manual_seed(0))
    picks = {}
    for name, g in (("spiky", spiky), ("spread", spread)):
        nxt = pol.update(st, GradStats(0, float(g.abs().max()), float(g.norm() / d ** 0.5), pol.cost(st.count, 2), g))
        assert pol.cost(nxt.count, nxt.bits) <= nxt.allowance
        picks[name] = (nxt.bits, nxt.count)
    assert picks["spiky"][0] > picks["spread"][0] and picks["spiky"][1] < picks["spread"][1], picks


def test_budget_is_never_overspent_and_an_infeasible_one_is_refused() -> None:
    with pytest.raises(ValueError, match="infeasible budget"):
        budget_policy(method_config("topk-budget", target_bits=0.01), 1000, 10)
    pol = SparseBudget(40_000, 20, 3000, message_cost(3000, 4), "randk", 4, 2, 8)
    st, spent, g = pol.init(), 0, torch.Generator().manual_seed(1)
    for r in range(20):
        cost = pol.cost(st.count, st.bits)
        spent += cost
        x = torch.randn(3000, generator=g) ** 3
        st = pol.update(st, GradStats(r, float(x.abs().max()), float(x.norm() / 3000 ** 0.5), cost, x))
        assert spent <= 40_000 and st.spent == spent
    assert spent >= 40_000 - pol.cost(1, 8) * 2  # what is left at the end is less than a message


# --- the trainer's rounds --------------------------------------------------------------------------------------------
def trainer(method: str = "topk", **kw) -> Trainer:
    cfg = train_config(**{"topology": "sharded", "momentum": 0.9, "local_steps": 4, "steps": 18, **kw})
    return Trainer(cfg, entry(method), DATA, 0, SimTransport(cfg.workers, cfg.topology))


@pytest.mark.parametrize("method,kw", [("topk", {}), ("randk", dict(topology="allgather")),
                                       ("topk-budget", dict(outer_optimizer="nesterov", outer_lr=0.7,
                                                            outer_momentum=0.9)),
                                       ("topk-budget", dict(fragments=2, overlap_steps=1, topology="allgather"))])
def test_resume_mid_round_is_exact(method: str, kw: dict) -> None:
    full = trainer(method, **kw)
    for _ in range(18):
        full.step()
    part = trainer(method, **kw)
    for _ in range(6):
        part.step()
    buf = io.BytesIO()
    torch.save(part.state_dict(), buf)
    buf.seek(0)
    resumed = trainer(method, **kw)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for _ in range(12):
        resumed.step()
    assert torch.equal(full.flat_params(), resumed.flat_params())
    assert [(r.step, r.bits, r.up_bytes) for r in full.ledger.records] == \
        [(r.step, r.bits, r.up_bytes) for r in resumed.ledger.records]
    if method.startswith("topk"):
        assert any(r is not None and float(r.abs().max()) > 0 for r in full.state.residuals) or kw.get("fragments")


def test_rounds_send_what_the_wire_predicts_and_the_budget_holds() -> None:
    tr = trainer("topk", topology="ps")
    for _ in range(18):
        tr.step()
    k = density_count(tr.numel, 0.01)
    assert [r.up_bytes for r in tr.ledger.records] == [[sparse_message_size(tr.numel, k, 2)] * 4] * 5
    tr = trainer("topk-budget")
    for _ in range(18):
        tr.step()
    budget = math.floor(5 * tr.numel * 0.25)
    assert 8 * sum(max(r.up_bytes) for r in tr.ledger.records) <= budget
    assert len({(r.bits) for r in tr.ledger.records}) > 1  # the width changes with the rounds


def test_sparse_methods_are_refused_where_they_cannot_run() -> None:
    with pytest.raises(ValueError, match="sparse-budget"):
        method_config("topk", policy="dqsgd-budget", target_bits=4.0)
    with pytest.raises(ValueError, match="coding"):
        method_config("topk", coding="auto")
    with pytest.raises(ValueError, match="topk_ratio"):
        method_config("randk", topk_ratio=0.0)
    with pytest.raises(ValueError, match="sharded or allgather"):
        trainer("topk-budget", topology="ps")
    per_step = trainer("topk", local_steps=1)
    with pytest.raises(ValueError, match="Local SGD runs it"):
        per_step.step()
    from dqsgd.method.config import check_one_message
    with pytest.raises(ValueError, match="Local SGD runs it"):
        check_one_message(method_config("randk"), "the DDP hook")


@pytest.mark.parametrize("topology", ["ps", "sharded"])
def test_a_forged_message_size_is_refused_before_allocating(topology: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose message is longer than k coordinates of its shard can carry: every rank refuses
    it from the size table (the exchange's one size bound), before any buffer of that size is made."""
    d, k, bits, workers = 200, 20, 4, 2
    m = Method(method_config("topk", topk_ratio=k / d, bits=bits), d, 4, [d])
    step = SparseStep(m, topology, workers, 0, 32)
    honest = step.compress

    def forged(p: torch.Tensor, k: int, bits: int, gen: torch.Generator) -> tuple[list[bytes], torch.Tensor]:
        msgs, xhat = honest(p, k, bits, gen)
        return ([msgs[0] + bytes(10_000)] + msgs[1:] if gen is gens[1] else msgs), xhat

    gens = {w: generator(0, QUANT, w) for w in range(workers)}
    monkeypatch.setattr(step, "compress", forged)
    g = torch.Generator().manual_seed(3)
    deltas = {w: torch.randn(d, generator=g) for w in range(workers)}
    with pytest.raises(PayloadError, match=r"rank 1 announced a payload of \d+ bytes.*refused before allocating"):
        step.run(SimTransport(workers, topology), deltas, m.init_state(workers, step.policy), 0, gens)


@pytest.mark.parametrize("topology", ["ps", "sharded"])
def test_the_downlink_carries_what_is_counted(topology: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every byte the downlink leg puts on the wire, counted collective by collective (what a rank sends to
    the others), is a counted payload byte, its one status byte, or its 8-byte length: no padding. The
    sharded downlink once all-gathered every server's message padded to the largest cap (W·k coordinates),
    so it carried several times the bytes counted (3.1× here)."""
    import dqsgd.topology.group as group

    d, workers = 4000, 4
    m = Method(method_config("topk", topk_ratio=0.01, bits=3), d, 4, [d])
    step = SparseStep(m, topology, workers, 0, 8)
    wire = [0]

    def counted(kind: str, original):  # type: ignore[no-untyped-def]
        def call(self, *args):  # type: ignore[no-untyped-def]
            t, leg = args[0], args[-1]
            if leg == group.DOWN:
                n = t.numel() * t.element_size()
                if kind == "all_gather":
                    wire[0] += n * (self.size - 1)
                elif kind == "all_to_all":
                    wire[0] += (sum(args[1]) - args[1][self.rank]) * t.element_size()
                elif self.rank == args[1]:  # broadcast from its source
                    wire[0] += n * (self.size - 1)
            return original(self, *args)
        return call

    for kind in ("all_gather", "all_to_all", "broadcast"):
        monkeypatch.setattr(group.LocalGroup, kind, counted(kind, getattr(group.LocalGroup, kind)))
    g = torch.Generator().manual_seed(5)
    deltas = {w: torch.randn(d, generator=g) for w in range(workers)}
    gens = {w: generator(0, QUANT, w) for w in range(workers)}
    out = step.run(SimTransport(workers, topology), deltas, m.init_state(workers, step.policy), 0, gens)
    servers = len(out.down)
    assert servers == (workers if topology == "sharded" else 1) and min(out.down) > 0
    assert wire[0] == (workers - 1) * (sum(out.down) + servers * (1 + 8))


@pytest.mark.parametrize("topology", ["ps", "sharded"])
def test_a_forged_downlink_length_is_refused_before_allocating(topology: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard server (ps: the server) whose downlink is longer than W·k coordinates of its shard can carry:
    every rank refuses its announced length (the one size bound) before receiving it."""
    d, workers = 400, 2
    m = Method(method_config("topk", topk_ratio=0.05, bits=3), d, 4, [d])
    step = SparseStep(m, topology, workers, 0, 8)
    honest = step.down_message
    monkeypatch.setattr(step, "down_message", lambda j, avg, n: honest(j, avg, n) + bytes(10_000))
    g = torch.Generator().manual_seed(7)
    deltas = {w: torch.randn(d, generator=g) for w in range(workers)}
    gens = {w: generator(0, QUANT, w) for w in range(workers)}
    with pytest.raises(PayloadError, match=r"sparse downlink.*\d+ bytes.*refused before allocating"):
        step.run(SimTransport(workers, topology), deltas, m.init_state(workers, step.policy), 0, gens)
