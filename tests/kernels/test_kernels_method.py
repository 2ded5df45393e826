"""``MethodConfig.kernel = "fused"`` in the pipeline, and the decode-accumulate aggregate."""

import pytest
import torch
from bucket_ref import aggregate

from dqsgd.codecs import decode
from dqsgd.codecs import encode
from dqsgd.kernels import HashRNG, encode_uniform_fast, quantize_uniform_hash
from dqsgd.method.config import METHODS, method_config
from dqsgd.method.pipeline import Method
from dqsgd.quantizers import Layout, dequantize

D, W = 1000, 3


def grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(D, generator=gen) for _ in range(W)]


@pytest.mark.parametrize("kernel", ["fused", "torch"])
@pytest.mark.parametrize("name", sorted(set(METHODS) - {"sketched-sgd", "topk", "randk", "topk-budget"}) + ["qsgd-2bit", "qsgd-8bit"])
def test_aggregate_is_bit_identical_to_the_scaled_sum_of_dequantized(name: str, kernel: str) -> None:
    """G = Σ_w (1/W)·x̂_w in worker order, each term rounded to float32 (the scale before the sum)."""
    m = Method(method_config(name, kernel=kernel), D, 20, [600, 300, 100])
    bits = m.init_state(W).bits
    gs = grads(0)
    scalers = torch.stack([m.local_scalers(g) for g in gs]).amax(0) if m.shares_scalers else None
    msgs = [m.encode(g, bits, torch.Generator().manual_seed(w), None, scalers,
                     hash_rng=HashRNG(0, 0, w) if m.fused else None)[0] for w, g in enumerate(gs)]
    agg = aggregate(m, msgs, bits)
    if m.config.aggregate == "mean":
        total, weight = torch.zeros(D), torch.tensor(1.0 / W, dtype=torch.float32)
        for p in msgs:
            total += weight * dequantize(decode(p)).reshape(-1)
        assert torch.equal(agg, total)


@pytest.mark.parametrize("coding", ["fixed", "zstd", "zstd-aligned", "elias", "rans", "ransx", "auto"])
def test_fused_method_sends_the_hash_rng_quantizer(coding: str) -> None:
    m = Method(method_config("qsgd", bits=4, kernel="fused", coding=coding, bucket=128), D, 20)
    g = grads(1)[0]
    rng = HashRNG(9, 4, 1)
    msg, residual = m.encode(g, 4, None, hash_rng=rng)
    assert residual is None
    ref = quantize_uniform_hash(g, 4, rng, layout=Layout(bucket=128))
    assert torch.equal(decode(msg).codes, ref.codes)
    assert msg == encode(ref, m.coding)
    assert torch.equal(aggregate(m, [msg], 4), dequantize(ref))


def test_fused_method_needs_the_key_and_is_reproducible() -> None:
    m = Method(method_config("dqsgd", kernel="fused"), D, 20)
    g = grads(2)[0]
    with pytest.raises(ValueError, match="hash_rng"):
        m.encode(g, 4, torch.Generator())
    a = m.encode(g, 4, None, hash_rng=HashRNG(1, 2, 3))[0]
    assert a == m.encode(g, 4, None, hash_rng=HashRNG(1, 2, 3))[0] == encode_uniform_fast(g, 4, HashRNG(1, 2, 3))
    assert a != m.encode(g, 4, None, hash_rng=HashRNG(1, 3, 3))[0]


def test_fused_error_feedback_keeps_the_invariant() -> None:
    m = Method(method_config("qsgd", bits=3, kernel="fused", error_feedback=True), D, 20)
    residual = None
    for step, g in enumerate(grads(3)):
        p = g if residual is None else g + residual
        msg, residual = m.encode(g, 3, None, residual, hash_rng=HashRNG(0, step, 0))
        assert torch.allclose(dequantize(decode(msg)) + residual, p, atol=1e-6)


def test_kernel_option_is_validated_and_ignored_by_other_schemes() -> None:
    with pytest.raises(ValueError, match="kernel must be one of"):
        method_config("qsgd", kernel="cuda")
    m = Method(method_config("signsgd", kernel="fused"), D, 20)
    assert not m.fused and m.encode(grads(4)[0], 1, None)[0]
