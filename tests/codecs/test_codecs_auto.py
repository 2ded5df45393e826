"""AUTO writes only its winner: the coding and bytes it picks are those of coding all four candidates
and keeping the smallest (ties to the earlier of FIXED, ELIAS, ZSTD_ALIGNED, rANS; the rANS candidate is
RANSX from RANSX_MIN_CODES codes on, else RANS), from size bounds that are checked here against the real
bodies; above ZSTD_EXACT_BYTES zstd is tried on a sample first."""

from __future__ import annotations

import numpy as np
import pytest

from codec_strategies import SETTINGS, code_bounds, random_codes
from hypothesis import given, settings
from hypothesis import strategies as st

from dqsgd.codecs import Coding, auto, decode, encode
from dqsgd.codecs.auto import RANSX_MIN_CODES, ZSTD_EXACT_BYTES, level_stats, rans_candidate
from dqsgd.codecs.elias import elias_encode
from dqsgd.codecs.rans import level_histogram
from dqsgd.codecs.rans import rans_encode
from dqsgd.codecs.ransx import ransx_encode
from dqsgd.codecs.wire import fixed_body, _smallest_body, body_width, zstd_compress
import torch

from dqsgd.quantizers.base import Layout, Norm, Quantized, Scheme


def _every_candidate(data: np.ndarray, bits: int, scheme: Scheme) -> tuple[Coding, bytes]:
    """The definition: code with every candidate, keep the first of the smallest."""
    cands = [(Coding.FIXED, fixed_body(data, bits, bits))]
    if scheme != Scheme.IDENTITY:
        cands.append((Coding.ELIAS, elias_encode(data)))
    cands.append((Coding.ZSTD_ALIGNED, zstd_compress(fixed_body(data, bits, body_width(bits, Coding.ZSTD_ALIGNED)))))
    if scheme != Scheme.IDENTITY:
        rans = Coding.RANSX if data.size >= RANSX_MIN_CODES else Coding.RANS
        cands.append((rans, (ransx_encode if rans == Coding.RANSX else rans_encode)(data, bits)))
    coding, body = min(cands, key=lambda c: memoryview(c[1]).nbytes)  # min keeps the first of equals
    return coding, bytes(memoryview(body))


def _levels(rng: np.random.Generator, n: int, bits: int, kind: str) -> np.ndarray:
    s = (1 << (bits - 1)) - 1
    if kind == "dense":  # max-norm levels of a Gaussian: rANS territory
        g = rng.standard_normal(n)
        return np.floor(g / max(np.abs(g).max(initial=0.0), 1e-12) * s + rng.random(n)).astype(np.int32)
    if kind == "sparse":  # l2-norm levels: mostly zero, Elias territory
        return (rng.random(n) < 0.02).astype(np.int32) * rng.choice([-1, 1], n).astype(np.int32)
    if kind == "runs":  # long repeats: zstd territory
        return np.repeat(rng.integers(-s, s + 1, max(n // 64, 1)), 64)[:n].astype(np.int32)
    return rng.integers(-s, s + 1, n).astype(np.int32)  # uniform over the grid: FIXED territory


@pytest.mark.parametrize("kind", ["dense", "sparse", "runs", "flat"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_auto_picks_and_writes_what_coding_every_candidate_would(kind: str, bits: int) -> None:
    rng = np.random.default_rng(bits * 7 + len(kind))
    for n in (0, 1, 7, 64, 1000, 20_000):
        data = _levels(rng, n, bits, kind)
        coding, body = _smallest_body(data, bits, Scheme.UNIFORM)
        want = _every_candidate(data, bits, Scheme.UNIFORM)
        assert (coding, bytes(memoryview(body))) == want, (kind, bits, n)


def test_every_coding_can_win() -> None:
    rng = np.random.default_rng(0)
    few = np.array([1, -1, 0, 1, -1], dtype=np.int32)  # 5 codes: any table costs more than 2 bytes
    rare = np.zeros(20_000, dtype=np.int32)
    rare[[17, 9000, 19_999]] = [1, -1, 1]  # three non-zeros: a handful of Elias bytes, no table
    got = [_smallest_body(d, b, Scheme.UNIFORM)[0] for d, b in
           ((few, 2), (rare, 4), (_levels(rng, 20_000, 8, "runs"), 8), (_levels(rng, 20_000, 4, "dense"), 4))]
    assert got == [Coding.FIXED, Coding.ELIAS, Coding.ZSTD_ALIGNED, Coding.RANS]


def test_auto_on_identity_and_one_bit_payloads() -> None:
    rng = np.random.default_rng(1)
    floats = rng.standard_normal(1000).astype(np.float32)
    assert _smallest_body(floats, 32, Scheme.IDENTITY)[0] in (Coding.FIXED, Coding.ZSTD_ALIGNED)
    coding, body = _smallest_body(floats, 32, Scheme.IDENTITY)
    assert (coding, bytes(memoryview(body))) == _every_candidate(floats, 32, Scheme.IDENTITY)
    signs = rng.choice([-1, 1], 999).astype(np.int32)
    coding, body = _smallest_body(signs, 1, Scheme.SIGN)
    assert (coding, bytes(memoryview(body))) == _every_candidate(signs, 1, Scheme.SIGN)


@settings(SETTINGS, max_examples=80)
@given(bits=st.integers(1, 16), n=st.integers(0, 5000), seed=st.integers(0, 2**32 - 1),
       density=st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]))
def test_predicted_sizes_are_the_encoded_sizes_and_the_choice_exact(bits: int, n: int, seed: int,
                                                                      density: float) -> None:
    lo, hi, zero_ok = code_bounds(Scheme.LOWPREC, bits, 1)
    data = random_codes(seed, n, lo, hi, zero_ok, density)
    hist, elias = level_stats(data, bits)
    assert np.array_equal(hist, level_histogram(data, bits)) and elias == elias_encode(data).size
    coding, body = _smallest_body(data, bits, Scheme.LOWPREC)
    assert (coding, bytes(memoryview(body))) == _every_candidate(data, bits, Scheme.LOWPREC)


@pytest.mark.parametrize("kind", ["dense", "runs", "sparse"])
def test_big_bodies_pick_the_smallest_of_the_candidates_they_try(kind: str) -> None:
    """Above ZSTD_EXACT_BYTES zstd is tried when a sample predicts it close: on these inputs the sample
    is right either way, so AUTO is still the smallest of all four; and the payload decodes to the codes."""
    rng = np.random.default_rng(3)
    n = 2 * ZSTD_EXACT_BYTES + 123  # 4-bit codes in aligned bytes: 2 × the exact limit
    data = _levels(rng, n, 4, kind)
    coding, body = _smallest_body(data, 4, Scheme.UNIFORM)
    assert (coding, bytes(memoryview(body))) == _every_candidate(data, 4, Scheme.UNIFORM)
    q = Quantized(Scheme.UNIFORM, 4, 7, torch.from_numpy(data), torch.ones(1), Layout(), (data.size,), Norm.MAX)
    assert torch.equal(decode(encode(q, Coding.AUTO)).codes, q.codes)


def _fastest(data: np.ndarray, bits: int, link_mbit: float, cpu: dict[Coding, float]) -> Coding:
    """The definition with a link: the least modelled time CPU_NS[c]·n + 8·bytes/rate over all four."""
    sizes = {c: memoryview(_every_candidate_of(data, bits, c)).nbytes for c in cpu}
    return min(cpu, key=lambda c: (cpu[c] * data.size + 8000.0 * sizes[c] / link_mbit, list(cpu).index(c)))


def _every_candidate_of(data: np.ndarray, bits: int, coding: Coding) -> bytes | np.ndarray:
    if coding == Coding.ELIAS:
        return elias_encode(data)
    if coding == Coding.RANS:
        return rans_encode(data, bits)
    if coding == Coding.RANSX:
        return ransx_encode(data, bits)
    if coding == Coding.ZSTD_ALIGNED:
        return zstd_compress(fixed_body(data, bits, body_width(bits, coding)))
    return fixed_body(data, bits, bits)


@pytest.mark.parametrize("kind", ["dense", "sparse", "runs", "flat"])
@pytest.mark.parametrize("link_mbit", [1e-3, 30.0, 100.0, 300.0, 1000.0, 1e6])
def test_with_a_link_rate_auto_sends_the_fastest(kind: str, link_mbit: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed CPU model (not a clock: the choice must be the same on every run and rank)."""
    cpu = {Coding.FIXED: 1.0, Coding.ELIAS: 12.0, Coding.ZSTD_ALIGNED: 6.0, Coding.RANS: 9.0}
    monkeypatch.setattr(auto, "CPU_NS", cpu)
    rng = np.random.default_rng(len(kind))
    for bits, n in ((2, 3000), (4, 20_000), (8, 5000)):
        data = _levels(rng, n, bits, kind)
        coding, body = auto.smallest_body(data, bits, True, link_mbit)
        assert coding == _fastest(data, bits, link_mbit, cpu), (kind, bits, n)
        assert bytes(memoryview(body)) == bytes(memoryview(_every_candidate_of(data, bits, coding)))
    if link_mbit == 1e6:  # bytes cost ~nothing: the cheapest CPU wins
        assert coding == Coding.FIXED


def test_link_rate_through_encode_and_the_method() -> None:
    rng = np.random.default_rng(5)
    data = _levels(rng, 50_000, 4, "dense")
    q = Quantized(Scheme.UNIFORM, 4, 7, torch.from_numpy(data), torch.ones(1), Layout(), (data.size,), Norm.MAX)
    assert decode(encode(q, Coding.AUTO, link_mbit=1e6)).codes.equal(q.codes)
    assert encode(q, Coding.AUTO, link_mbit=1e6)[5] == Coding.FIXED  # the header's coding byte
    assert encode(q, Coding.AUTO, link_mbit=1.0)[5] == Coding.RANS
    more = _levels(rng, RANSX_MIN_CODES, 4, "dense")
    big = Quantized(Scheme.UNIFORM, 4, 7, torch.from_numpy(more), torch.ones(1), Layout(), (more.size,), Norm.MAX)
    assert encode(big, Coding.AUTO, link_mbit=1.0)[5] == Coding.RANSX == rans_candidate(big.numel)
    with pytest.raises(ValueError, match="link_mbit"):
        encode(q, Coding.AUTO, link_mbit=-1.0)
    from dqsgd.method.config import method_config

    assert method_config("dqsgd-coded", link_mbit=100.0).link_mbit == 100.0
    with pytest.raises(ValueError, match="link_mbit chooses among the codings of coding 'auto'"):
        method_config("qsgd-4bit", link_mbit=100.0)
    with pytest.raises(ValueError, match="finite rate"):
        method_config("dqsgd-coded", link_mbit=float("inf"))


def test_the_reused_zstd_compressor_writes_a_fresh_ones_bytes() -> None:
    """zstd_compress keeps one compressor per thread: after frames of other sizes and contents it must
    still write, byte for byte, the frame of a compressor that never compressed anything."""
    import threading

    import zstandard

    from dqsgd.codecs.bodies import ZSTD_LEVEL

    rng = np.random.default_rng(4)
    bodies = [rng.integers(0, k, n, dtype=np.uint8).tobytes() for n, k in ((5, 2), (200_000, 4), (4096, 256), (0, 1),
                                                                          (70_000, 3), (4096, 256))]
    got: list[list[bytes]] = []

    def run() -> None:
        got.append([zstd_compress(b) for b in bodies])

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    run()
    want = [zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b) for b in bodies]
    assert len(got) == 3 and all(g == want for g in got)
