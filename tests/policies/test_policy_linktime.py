"""The link-time choice (docs/algorithms.md §11.5b) as mathematics: argmin of the stated objective,
and the direction it moves in when the link, the codec or the gradient noise changes."""

import itertools
import math

import pytest

from dqsgd.policies.linktime import UNCOMPRESSED, Choice, LinkEstimate, TimeModel, agree, calibrated, choose, time_codec

D, W = 1 << 20, 4
WIDTHS = range(1, 17)
# FIXED: width bits per coordinate, cheap; "coded": about a third of the bits, 6x the CPU.
FIXED = dict(codec_ns={"fixed": [2.5] * 16}, wire_bits={"fixed": [float(b) for b in WIDTHS]})


def model(mbit, **kw):
    return TimeModel(mbit=mbit, latency_s=1e-4, compute_s=0.02, header_bits=256, **{**FIXED, **kw})


def coded(cpu_ns):
    return dict(codec_ns={"fixed": [2.5] * 16, "coded": [cpu_ns] * 16},
                wire_bits={"fixed": [float(b) for b in WIDTHS], "coded": [b / 3.0 for b in WIDTHS]})


def j_by_hand(m, c, norm, sigma2):
    """The objective written out from the docs, independently of the module."""
    def s(b):
        return 2 ** (b - 1) - 1

    def q(b):
        return 0.0 if b == 0 else D * norm ** 2 / (6 * s(b) ** 2)

    def t(b):
        if b == 0:
            return m.messages * (m.latency_s + 32 * D / (m.mbit * 1e6))
        return D * m.codec_ns[c.coding][b - 1] * 1e-9 + m.messages * (
            m.latency_s + (m.header_bits + D * m.wire_bits[c.coding][b - 1]) / (m.mbit * 1e6))
    return (1 + (q(c.up) / W + q(c.down)) / sigma2) * (m.compute_s + t(c.up) + t(c.down))


@pytest.mark.parametrize("mbit", [10.0, 100.0, 1000.0, 10000.0])
@pytest.mark.parametrize("cpu", [5.0, 17.0, 60.0])
@pytest.mark.parametrize("norm,sigma2", [(1e-3, 1e-2), (1e-2, 1e-3), (1.0, 1.0)])
def test_choice_is_the_brute_force_argmin(mbit, cpu, norm, sigma2):
    m = model(mbit, **coded(cpu))
    got = choose(m, d=D, norm=norm, sigma2=sigma2, workers=W)
    everything = [Choice(0, 0, "")] + [Choice(u, w, c) for c in ("coded", "fixed") for u in range(2, 17)
                                       for w in (0, *range(2, 17))]
    best = min(j_by_hand(m, c, norm, sigma2) for c in everything)
    assert j_by_hand(m, got, norm, sigma2) == pytest.approx(best, rel=1e-12)


def widths(mbit, sigma2=1e-3, **kw):
    c = choose(model(mbit, **kw), d=D, norm=1e-2, sigma2=sigma2, workers=W, uncompressed=False)
    return tuple(32 if b == UNCOMPRESSED else b for b in (c.up, c.down))  # the dtype: the widest


def test_faster_link_wider_slower_narrower():
    seq = [widths(mbit) for mbit in (1.0, 10.0, 100.0, 1000.0, 10000.0)]
    for (u0, d0), (u1, d1) in itertools.pairwise(seq):
        assert u1 >= u0 and d1 >= d0
    assert seq[-1][0] > seq[0][0] and seq[-1][1] > seq[0][1]


def test_slower_codec_less_coding():
    picks = [choose(model(100.0, **coded(cpu)), d=D, norm=1e-2, sigma2=1e-3, workers=W).coding
             for cpu in (3.0, 10.0, 30.0, 100.0, 300.0)]
    assert picks[0] == "coded" and picks[-1] == "fixed"
    assert picks == sorted(picks)  # once "fixed", it stays "fixed" as the codec gets slower


def test_link_faster_than_codec_sends_uncompressed():
    # 32 bits at 100 Gbit/s is 0.32 ns per coordinate: less than any codec's 2.5 ns
    assert choose(model(1e5), d=D, norm=1e-2, sigma2=1e-3, workers=W) == Choice(UNCOMPRESSED, UNCOMPRESSED, "")
    assert choose(model(10.0), d=D, norm=1e-2, sigma2=1e-3, workers=W).up != UNCOMPRESSED


def test_more_gradient_noise_narrower():
    # a larger sampling variance hides more quantization noise: ρ grows less per lost bit
    quiet = widths(100.0, sigma2=1e-5)
    noisy = widths(100.0, sigma2=1e-1)
    assert noisy[0] <= quiet[0] and noisy[1] <= quiet[1] and noisy != quiet


def test_bad_figures_refused():
    with pytest.raises(ValueError, match="throughput"):
        TimeModel(mbit=0.0)
    with pytest.raises(ValueError, match="same codings"):
        TimeModel(mbit=1.0, codec_ns={"fixed": [1.0]}, wire_bits={})
    with pytest.raises(ValueError, match="sigma2"):
        choose(model(1.0), d=D, norm=1.0, sigma2=0.0, workers=W)


def test_link_estimate_and_agreement():
    e = LinkEstimate().observe(100, 1e-3)  # small: latency
    e = e.observe(1 << 20, 1e-3 + (1 << 20) * 8e-9)  # 1 Gbit/s
    assert e.latency_s == 1e-3 and e.mbit() == pytest.approx(1000.0, rel=1e-9)
    ranks = [[1.0, 5.0], [2.0, 3.0]]
    def reduce_max(v):  # what an all-reduce MAX over the two ranks returns on each
        return [max(col) for col in zip(*ranks)]
    assert agree(ranks[0], reduce_max) == agree(ranks[1], reduce_max) == [2.0, 5.0]


def test_codec_timing_is_cached():
    calls = []
    out = time_codec(lambda w, c: calls.append((w, c)), [2, 4], ["fixed"], n=1000, repeats=2, cache=(cache := {}))
    assert len(calls) == 4 and set(cache) == {(1000, 2, "fixed"), (1000, 4, "fixed")}
    assert all(math.isfinite(v) and v >= 0 for v in out["fixed"])
    time_codec(lambda w, c: calls.append((w, c)), [2, 4], ["fixed"], n=1000, cache=cache)
    assert len(calls) == 4


def test_calibrated_model_predicts_the_timed_steps():
    m = model(100.0, **coded(17.0))
    fixed, rans = Choice(4, 8, "fixed"), Choice(4, 8, "coded")
    bare = TimeModel(**{**m.__dict__, "compute_s": 0.0})
    per = {c: bare.step_s(D, c) * 1e9 / D for c in (fixed, rans, Choice(0, 0, ""))}
    slow = calibrated(m, D, [(fixed, per[fixed] + 300.0), (rans, per[rans] + 900.0)],
                      plain_ns=per[Choice(0, 0, "")] + 40.0)
    assert slow.step_ns == pytest.approx({"fixed": 300.0, "coded": 900.0}, rel=1e-9)
    assert slow.plain_ns == pytest.approx(40.0, rel=1e-9)
    # the calibrated model predicts each timed step (plus compute)
    for c, extra in ((fixed, 300.0), (rans, 900.0), (Choice(0, 0, ""), 40.0)):
        assert slow.step_s(D, c) == pytest.approx(m.compute_s + bare.step_s(D, c) + extra * 1e-9 * D, rel=1e-12)
    # a step timed faster than the model adds nothing: the model's own figures stay
    fast = calibrated(m, D, [(fixed, 0.0), (rans, 0.0)], plain_ns=0.0)
    assert fast.step_ns == {"fixed": 0.0, "coded": 0.0} and fast.plain_ns == 0.0
    # a coding whose step costs more than the model says is chosen less: here, not at all
    assert choose(slow, d=D, norm=1e-2, sigma2=1e-3, workers=W).coding != "coded"


@pytest.mark.parametrize("step_ns,plain_ns", [(0.0, 0.0), (50.0, 0.0), (400.0, 10.0), (5.0, 200.0)])
@pytest.mark.parametrize("mbit", [10.0, 100.0, 1000.0])
def test_choice_with_step_costs_is_the_brute_force_argmin(step_ns, plain_ns, mbit):
    m = TimeModel(**{**model(mbit, **coded(17.0)).__dict__, "step_ns": {"fixed": step_ns, "coded": 2 * step_ns},
                     "plain_ns": plain_ns})
    got = choose(m, d=D, norm=1e-2, sigma2=1e-3, workers=W)
    everything = [Choice(0, 0, "")] + [Choice(u, w, c) for c in ("coded", "fixed") for u in range(2, 17)
                                       for w in (0, *range(2, 17))]

    def j(c):  # the hand-written objective plus σ, the step's measured cost by kind
        sigma = plain_ns if (c.up, c.down) == (0, 0) else step_ns * (2 if c.coding == "coded" else 1)
        rho = j_by_hand(m, c, 1e-2, 1e-3) / (m.compute_s + _t(m, c))
        return rho * (m.compute_s + _t(m, c) + D * sigma * 1e-9)
    assert j(got) == pytest.approx(min(map(j, everything)), rel=1e-12)


def _t(m, c):
    """Both directions' seconds, written out as in j_by_hand."""
    def t(b):
        if b == 0:
            return m.messages * (m.latency_s + 32 * D / (m.mbit * 1e6))
        return D * m.codec_ns[c.coding][b - 1] * 1e-9 + m.messages * (
            m.latency_s + (m.header_bits + D * m.wire_bits[c.coding][b - 1]) / (m.mbit * 1e6))
    return t(c.up) + t(c.down)


def test_slower_compressed_step_sends_uncompressed_faster_plain_step_too():
    """A slow CPU (a large measured cost of the compressed step) moves the choice to uncompressed, and
    once there it stays; a slow plain all-reduce moves it back to compressing."""
    def pick(step_ns, plain_ns=0.0):
        m = TimeModel(**{**model(1000.0).__dict__, "step_ns": {"fixed": step_ns}, "plain_ns": plain_ns})
        return choose(m, d=D, norm=1e-2, sigma2=1e-3, workers=W)
    picks = [pick(s).up == UNCOMPRESSED for s in (0.0, 10.0, 30.0, 100.0, 300.0, 1000.0)]
    assert not picks[0] and picks[-1] and picks == sorted(picks)
    assert pick(1000.0, plain_ns=1e4).up != UNCOMPRESSED
    with pytest.raises(ValueError, match="step_ns"):
        TimeModel(mbit=1.0, step_ns={"fixed": -1.0})
