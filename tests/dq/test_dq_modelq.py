"""Downlink model quantization: the μ-rule is the smallest width meeting the bound, the bound holds
(Monte-Carlo, through the real bytes), and the fallbacks (snapshot flag, fp32) behave."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dqsgd.codecs import PayloadError
from dqsgd.dq.modelq import (
    FP32_MODEL, SNAPSHOT_FLAG, ModelKind, ModelPrecision, choose_model_precision, decode_model, encode_model,
    mu_rule_bits,
)


def _bound_holds(b: int, x_inf: float, diff: float, d: int, mu: float) -> bool:
    return d * (x_inf / ((1 << (b - 1)) - 1)) ** 2 / 4 <= mu * diff * diff


@settings(max_examples=300)
@given(x_inf=st.floats(1e-6, 1e3), diff=st.floats(1e-6, 1e3), d=st.integers(1, 10**7), mu=st.floats(1e-3, 10.0))
def test_mu_rule_is_the_smallest_width_meeting_the_bound(x_inf, diff, d, mu) -> None:
    b = mu_rule_bits(x_inf, diff, d, mu)
    assert b >= 2 and _bound_holds(b, x_inf, diff, d, mu)
    assert b == 2 or not _bound_holds(b - 1, x_inf, diff, d, mu)
    # the closed form of docs/algorithms.md §9.2 gives the same width (up to float rounding at the boundary)
    closed = max(2, 1 + math.ceil(math.log2(1 + math.sqrt(d) * x_inf / (2 * math.sqrt(mu) * diff))))
    assert abs(closed - b) <= 1


@pytest.mark.parametrize("d,mu,scale,centred", [(50, 0.5, 0.3, False), (400, 0.1, 1.0, False), (400, 2.0, 0.05, False),
                                                (400, 0.5, 0.01, True)])
def test_model_quantization_error_within_its_bound(d, mu, scale, centred) -> None:
    """E‖Q(x) − x‖² ≤ d·δ_x²/4 ≤ μ‖x − x̃‖², Q taken through encode_model → bytes → decode_model."""
    g = torch.Generator().manual_seed(d)
    x_tilde = torch.randn(d, generator=g)
    x = x_tilde + scale * torch.randn(d, generator=g)
    policy = ModelPrecision(mu=mu, max_bits=16, centred=centred)
    choice = choose_model_precision(x, x_tilde, policy)
    assert choice.kind is ModelKind.LOWPREC
    bound = d * choice.delta ** 2 / 4
    mu_bound = mu * float((x - x_tilde).double().square().sum())
    assert bound <= mu_bound * (1 + 1e-12)
    gen = torch.Generator().manual_seed(1)
    K = 300
    errs = torch.tensor([float((decode_model(encode_model(x, x_tilde, policy, gen)[0], x_tilde, policy) - x)
                               .double().square().sum()) for _ in range(K)], dtype=torch.float64)
    # per-coordinate error (x−lo)(hi−x) ≤ δ²/4, each sample's total ≤ d·δ²: the SE of the MC mean is tiny
    se = float(errs.std()) / math.sqrt(K)
    assert float(errs.mean()) <= bound + 4 * se + 1e-6 * bound
    # and the exact expectation of stochastic rounding is within the bound too
    src = (x - x_tilde) if centred else x
    a = src.double() / choice.delta
    exact = float(((a - a.floor()) * (a.ceil() - a)).sum()) * choice.delta ** 2
    assert exact <= bound * (1 + 1e-9)
    assert abs(float(errs.mean()) - exact) <= 5 * se + 1e-9


def test_x_equal_snapshot_sends_the_one_byte_flag() -> None:
    x = torch.randn(100)
    for policy in (ModelPrecision(), FP32_MODEL):
        payload, choice = encode_model(x, x.clone(), policy, None)
        assert payload == SNAPSHOT_FLAG and len(payload) == 1 and choice.kind is ModelKind.SNAPSHOT
        assert torch.equal(decode_model(payload, x, policy), x)


def test_cap_binding_falls_back_to_fp32_exactly() -> None:
    x_tilde = torch.randn(1000)
    x = x_tilde.clone()
    x[3] += 1e-6  # ‖x − x̃‖ tiny: the rule asks for far more than 16 bits
    payload, choice = encode_model(x, x_tilde, ModelPrecision(mu=0.5, max_bits=16), None)
    assert choice.kind is ModelKind.FP32 and choice.rule_bits > 16
    assert torch.equal(decode_model(payload, x_tilde, ModelPrecision()), x)
    x2 = x_tilde + 0.01 * torch.randn(1000, generator=torch.Generator().manual_seed(0))
    _, small_cap = encode_model(x2, x_tilde, ModelPrecision(mu=0.5, max_bits=4), None)
    assert small_cap.kind is ModelKind.FP32 and small_cap.rule_bits > 4  # b_x,max = 4 binds


def test_fp32_policy_is_exact_and_model_bytes_scale_with_bx() -> None:
    x_tilde, x = torch.randn(4096), torch.randn(4096)
    p32, c32 = encode_model(x, x_tilde, FP32_MODEL, None)
    assert c32.kind is ModelKind.FP32 and torch.equal(decode_model(p32, x_tilde, FP32_MODEL), x)
    plp, clp = encode_model(x, x_tilde, ModelPrecision(mu=0.5), torch.Generator().manual_seed(0))
    assert clp.kind is ModelKind.LOWPREC and len(plp) < len(p32) * clp.bits / 32 + 64


def test_larger_mu_never_needs_more_bits() -> None:
    g = torch.Generator().manual_seed(3)
    x_tilde = torch.randn(2000, generator=g)
    x = x_tilde + 0.1 * torch.randn(2000, generator=g)
    bits = [choose_model_precision(x, x_tilde, ModelPrecision(mu=mu)).bits for mu in (0.1, 0.5, 1.0, 2.0)]
    assert bits == sorted(bits, reverse=True) and bits[0] > bits[-1]


def test_decoder_refuses_foreign_payloads() -> None:
    x = torch.randn(10)
    for bad in (b"", b"T", b"DQ\x01", bytes(40)):
        with pytest.raises(PayloadError):
            decode_model(bad, x, ModelPrecision())
    other, _ = encode_model(torch.randn(11), torch.zeros(11), FP32_MODEL, None)
    with pytest.raises(PayloadError):
        decode_model(other, x, FP32_MODEL)  # a model of the wrong length
