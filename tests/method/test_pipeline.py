"""Every registered method, through the real bytes: encode → decode → aggregate → downlink → policy."""

import math

import pytest
import torch
from bucket_ref import aggregate, decode_downlink, downlink

from dqsgd.codecs import PayloadError
from dqsgd.kernels import HashRNG
from dqsgd.method.config import METHODS, method_config
from dqsgd.topology.ledger import Ledger
from dqsgd.method.pipeline import Method, ProtocolError

D, W, N = 1000, 4, 50
SIZES = [600, 300, 100]


def grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(D, generator=gen) for _ in range(W)]


@pytest.mark.parametrize("name", sorted(set(METHODS) - {"sketched-sgd", "topk", "randk", "topk-budget"}) + ["qsgd-2bit", "qsgd-8bit"])
def test_every_method_runs_steps_with_measured_bytes(name: str) -> None:
    m = Method(method_config(name), D, N, SIZES)
    state = m.init_state(W)
    gens = [torch.Generator().manual_seed(w) for w in range(W)]
    led = Ledger(D, W, m.budget_bits())
    for step in range(5):
        gs = grads(step)
        bits = state.bits
        scalers = torch.stack([m.local_scalers(g) for g in gs]).amax(0) if m.shares_scalers else None
        msgs = []
        for w, g in enumerate(gs):
            msg, state.residuals[w] = m.encode(g, bits, gens[w], state.residuals[w], scalers,
                                               hash_rng=HashRNG(0, step, w) if m.fused else None)
            msgs.append(msg)
        agg = aggregate(m, msgs, bits)
        down = downlink(m, agg)
        update = decode_downlink(m, down)
        assert update.shape == (D,) and bool(torch.isfinite(update).all())
        led.record(step, bits, [len(p) for p in msgs], len(down))
        state = m.observe(state, agg, step, 8 * max(len(p) for p in msgs))
        if m.config.coding == "fixed":  # measured bytes == predicted bytes, every message
            nominal = m.config.nominal_bits() if m.config.scheme != "uniform" else bits
            if m.config.scheme != "identity":
                assert all(8 * len(p) == m.message_bits(nominal) for p in msgs)
    if led.budget_bits is not None:
        assert led.spent_bits() <= led.budget_bits
    s = led.summary()
    assert s["compression_ratio"] == pytest.approx(4 * D * W * 5 / (s["up_bytes"] + s["side_bytes"] / 2))


@pytest.mark.parametrize("kernel", ["fused", "torch"])
def test_qsgd_aggregate_is_unbiased_mean_of_workers(kernel: str) -> None:
    m = Method(method_config("qsgd", bits=3, kernel=kernel), D, N)
    gs = grads(0)
    true_mean = torch.stack(gs).mean(0).double()
    reps, acc = 400, torch.zeros(D, dtype=torch.float64)
    gens = [torch.Generator().manual_seed(100 + w) for w in range(W)]
    for rep in range(reps):
        acc += aggregate(m, [m.encode(g, 3, gens[w], hash_rng=HashRNG(100, rep, w) if m.fused else None)[0]
                            for w, g in enumerate(gs)], 3).double()
    mean = acc / reps
    # Var of the aggregate ≤ Σ_w (r_w/s)²/4 / W² per coordinate (s = 3).
    bound = sum(float(g.abs().max()) ** 2 for g in gs) / (4 * 9) / W**2
    assert float((mean - true_mean).abs().max()) <= 5 * math.sqrt(bound / reps)


def test_signsgd_majority_vote_and_one_bit_downlink() -> None:
    m = Method(method_config("signsgd"), D, N)
    gs = grads(1)
    msgs = [m.encode(g, 1, None)[0] for g in gs]
    agg = aggregate(m, msgs, 1)
    expected = torch.where(torch.stack([torch.where(g < 0, -1, 1) for g in gs]).sum(0) < 0, -1.0, 1.0)
    assert torch.equal(agg, expected)
    down = downlink(m, agg)
    assert len(down) < D // 8 + 64  # one bit per coordinate plus the header
    assert torch.equal(decode_downlink(m, down), agg)


def test_error_feedback_invariant_p_equals_sent_plus_residual() -> None:
    m = Method(method_config("ef-signsgd"), D, N, SIZES)
    from dqsgd.codecs import decode
    from dqsgd.quantizers import dequantize

    residual = None
    for step, g in enumerate(grads(2)):
        p = g if residual is None else g + residual
        msg, new_residual = m.encode(g, 1, None, residual)
        sent = dequantize(decode(msg))
        assert torch.allclose(sent + new_residual, p, atol=1e-6)
        residual = new_residual


def test_server_refuses_wrong_width_or_garbage_naming_the_worker() -> None:
    m = Method(method_config("qsgd", bits=4), D, N)
    rng = HashRNG(0, 0, 0)
    good = [m.encode(g, 4, None, hash_rng=rng)[0] for g in grads(3)]
    with pytest.raises(ProtocolError, match="worker 0.*at 4 bits"):
        aggregate(m, [m.encode(grads(3)[0], 5, None, hash_rng=rng)[0]] + good[1:], 4)
    with pytest.raises(PayloadError, match="worker 2"):
        aggregate(m, good[:2] + [b"garbage"] + good[3:], 4)
    with pytest.raises(ProtocolError, match="1000 values"):
        aggregate(m, [Method(method_config("qsgd", bits=4), 999, N).encode(torch.randn(999), 4, None, hash_rng=rng)[0]]
                    + good[1:], 4)


def test_nonfinite_gradient_refused() -> None:
    from dqsgd.quantizers import NonFiniteGradientError

    m = Method(method_config("dqsgd"), D, N)
    g = torch.randn(D)
    g[5] = float("nan")
    with pytest.raises(NonFiniteGradientError):
        m.encode(g, 4, None, hash_rng=HashRNG(0, 0, 0))
    with pytest.raises(NonFiniteGradientError):
        Method(method_config("dqsgd", kernel="torch"), D, N).encode(g, 4, None)


@pytest.mark.parametrize("kw,msg", [
    (dict(name="qsgd", bits=1), "bits must be in"), (dict(name="qsgd", bits=17), "bits must be in"),
    (dict(name="dqsgd-convex", alpha=0.0), "alpha"), (dict(name="dqsgd-convex", k=-1.0), "k"),
    (dict(name="dqsgd", target_bits=20.0), "target_bits"), (dict(name="dqsgd", coding="elias"), "coding"),
    (dict(name="signsgd", error_feedback=True), "error feedback"), (dict(name="nope"), "unknown method"),
    (dict(name="qsgd", colour=3), "unknown option"), (dict(name="qsgd", coding="gzip"), "coding must be one of"),
])
def test_bad_method_configs_refused(kw, msg) -> None:
    name = kw.pop("name")
    with pytest.raises(ValueError, match=msg):
        method_config(name, **kw)


def test_infeasible_budget_refused_up_front() -> None:
    with pytest.raises(ValueError, match="infeasible budget"):
        Method(method_config("dqsgd", target_bits=0.0, budget_bits=1000), D, N)


def test_error_target_policy_uses_theory_constant() -> None:
    from dqsgd.theory import formulas as theory

    m = Method(method_config("dqsgd-error", eps_q=1e-4, smoothness=2.0, lr=0.1), D, N)
    assert m.policy.k == pytest.approx(theory.error_target_t(2.0, 0.1, D, 1e-4))


def test_qsgd_names_carry_width_and_coding() -> None:
    """``qsgd-<B>bit[-<coding>]``: QSGD at B bits with a coding (QSGD's Elias coding, or auto); other
    suffixes are unknown methods."""
    from dqsgd.method.config import method_config

    assert (method_config("qsgd-2bit-auto").bits, method_config("qsgd-2bit-auto").coding) == (2, "auto")
    assert method_config("qsgd-4bit-elias").coding == "elias" and method_config("qsgd-4bit").coding == "fixed"
    assert method_config("qsgd-3bits-zstd-aligned").coding == "zstd-aligned"
    for bad in ("qsgd-2bit-huffman", "qsgd-2bit-", "qsgd-bit-auto"):
        with pytest.raises(ValueError, match="unknown method"):
            method_config(bad)
