"""σ̂² where no process holds ḡ (docs/algorithms.md §11.5c): the exchange gathers each rank's ‖g_r‖²
and realized rounding error e_r = ‖Q(g_r) − g_r‖², every rank holds the decoded update G, and
(Σ‖g_r‖² − W(‖G‖² − Σe_r/W²))/(W(W − 1)) is unbiased for σ² = tr Σ/W whatever the widths — checked
over repeated draws against 5 standard errors of the draws' own mean. The uncompressed choice of the
hook's policy: a link fast against the codec sends the dtype, a slow one compresses."""

import math

import pytest
import torch

from dqsgd.method.config import method_config
from dqsgd.policies import GradStats
from dqsgd.policies.link import LinkPolicy
from dqsgd.policies.linktime import UNCOMPRESSED
from dqsgd.policies.variance import modelled_rounding_variance, pooled_variance
from dqsgd.quantizers.constants import levels_for_bits
from dqsgd.theory.formulas import exact_quantization_variance
from dqsgd.topology.bucket import BucketProtocol
from dqsgd.topology.exchange import Exchange
from dqsgd.topology.group import local_groups
from dqsgd.topology.state import BucketState, Memory

D, W, TAU = 1000, 4, 0.3


def one_step_estimate(proto: BucketProtocol, step: int, gen: torch.Generator, grad: torch.Tensor) -> float:
    """One exchange step of W noisy copies of ``grad``: the σ̂² of the figures the policy was handed."""
    b = BucketState(numel=D, proto=proto, policy=proto.policy.init(), step=step)
    flats = [grad + TAU * torch.randn(D, generator=gen) for _ in range(W)]
    groups = local_groups(W)
    futures = Exchange(b).start({w: (flats[w], groups[w], Memory()) for w in range(W)})
    groups[0].wait(futures[0])
    s, m, w, v = b.policy.pending
    assert w == W
    return pooled_variance(s, m, int(w), v)


@pytest.mark.parametrize("topology,dbits,bits", [("allgather", 8, 3), ("sharded", "fp32", 2), ("sharded", "fp32", 5)])
def test_the_exchange_fed_estimate_is_unbiased(topology, dbits, bits) -> None:
    """σ² = D·τ²/W; 150 draws (fresh noise, fresh roundings: the step keys the hash uniforms). The
    estimate's mean is within 5 standard errors of σ² — at 2 bits, where the rounding noise
    (‖Q(g) − g‖² ≈ D·‖g‖∞²/(6·1²) per rank) is many times σ² itself and an uncorrected ‖G‖² would
    be off by far more than that."""
    cfg = method_config("dqsgd-link", bits=bits, min_bits=2, link_mbit=10.0, link_every=1)  # every step observed
    proto = BucketProtocol(cfg, D, [D], topology=topology, workers=W, seed=1, total_steps=1000,
                           downlink_bits=32 if dbits == "fp32" else dbits)
    gen = torch.Generator().manual_seed(bits)
    grad = torch.linspace(-1.0, 1.0, D)
    est = torch.tensor([one_step_estimate(proto, n, gen, grad) for n in range(150)], dtype=torch.float64)
    sigma2, se = D * TAU ** 2 / W, float(est.std()) / math.sqrt(len(est))
    assert abs(float(est.mean()) - sigma2) < 5 * se, (float(est.mean()), sigma2, se)


def test_the_modelled_downlink_variance_is_the_policys_q_and_near_the_exact_one() -> None:
    """Per shard n_j·(‖g_j‖∞/s)²/6: E‖Q_s(g) − g‖² with uniform fractional parts; against the closed
    form on a Gaussian vector whose fractional parts are near uniform at 8 bits (within 2 %: the
    sampling of 2·10⁵ fractional parts, f(1 − f) of spread 0.07, moves their mean by 0.1 %)."""
    g = torch.randn(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    bounds = [(0, 120_000), (120_000, 200_000)]
    s = levels_for_bits(8)
    model = modelled_rounding_variance(g, bounds, s, math.inf)
    by_hand = sum((hi - lo) * (float(g[lo:hi].abs().max()) / s) ** 2 / 6 for lo, hi in bounds)
    assert model == pytest.approx(by_hand, rel=1e-12)
    exact = sum(exact_quantization_variance(g[lo:hi], s, math.inf) for lo, hi in bounds)
    assert model == pytest.approx(exact, rel=0.02)


def hook_policy(mbit: float, dtype_bytes: int = 4) -> LinkPolicy:
    return LinkPolicy(D, mbit, 400.0, 4, compute_s=0.0, max_bits=8).sending(dtype_bytes, 8)


def test_a_link_faster_than_the_codec_sends_the_dtype_a_slow_one_compresses() -> None:
    """fp32 on the wire costs 32/R seconds per coordinate, the cheapest codec (fixed) 2.5 ns plus its
    bits: at 100 Gbit/s the dtype is faster than any width whatever σ̂² (ρ ≥ 1 for every width). At
    1 Mbit/s a 2..8-bit message is 4-16x faster, which pays for its noise where σ̂² is not tiny: at
    σ̂² = 1e-3 the 8-bit legs' q/σ̂² ≈ 200 extra steps per step cost more than the dtype's wire time
    (ρ − 1 = (q(8)/W + q(8))/σ̂², q(8) = D·‖g‖∞²/(6·127²) ≈ 0.17 here). 16-bit buckets move the crossing."""
    g = torch.randn(D, generator=torch.Generator().manual_seed(1))
    stats = GradStats(0, float(g.abs().max()), 0.0, 0, g)

    def choice(p: LinkPolicy, sigma2: float) -> tuple[int, int]:
        s = p.update(p.observe_workers(p.init(), W * (W - 1) * sigma2 + W, 1.0, W), stats)
        return s.bits, s.down_bits

    for sigma2 in (1e-3, 1.0, 1e3):
        assert choice(hook_policy(1e5), sigma2) == (UNCOMPRESSED, UNCOMPRESSED)
    for sigma2 in (1.0, 1e3):
        up, down = choice(hook_policy(1.0), sigma2)
        assert 2 <= up <= 8 and down == 8
    assert choice(hook_policy(1.0), 1e-3) == (UNCOMPRESSED, UNCOMPRESSED)
    # 2.5 ns per coordinate of codec against 16/R of fp16: the dtype wins above R = 16/2.5e-9 bit/s = 6400 Mbit/s
    assert choice(hook_policy(7000.0, 2), 1e3) == (UNCOMPRESSED, UNCOMPRESSED)
    assert choice(hook_policy(7000.0, 4), 1e3) != (UNCOMPRESSED, UNCOMPRESSED)


def test_no_noise_at_all_sends_the_dtype_where_the_caller_can() -> None:
    g = torch.randn(D, generator=torch.Generator().manual_seed(2))
    p = hook_policy(1.0)
    s = p.update(p.observe_workers(p.init(), 4.0, 1.0, 4), GradStats(0, float(g.abs().max()), 0.0, 0, g))
    assert s.sigma2 == 0 and (s.bits, s.down_bits) == (UNCOMPRESSED, UNCOMPRESSED)


def test_the_hook_policy_refuses_a_downlink_it_cannot_price() -> None:
    with pytest.raises(ValueError, match="downlink of 16 bits"):
        LinkPolicy(D, 10.0, 400.0, 4, max_bits=8).sending(4, 16)


def test_the_hook_checks_uncompressed_dtype() -> None:
    from dqsgd.ddp import HookState

    assert HookState("dqsgd-link", uncompressed_dtype="bfloat16").send_dtype(torch.float32) == torch.bfloat16
    assert HookState("dqsgd-link").send_dtype(torch.float32) == torch.float32
    with pytest.raises(ValueError, match="uncompressed_dtype must be one of"):
        HookState("dqsgd-link", uncompressed_dtype="float8")
    with pytest.raises(ValueError, match="uncompressed_dtype is the dtype the link policy"):
        HookState("qsgd-4bit", uncompressed_dtype="float16")
