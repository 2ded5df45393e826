"""The fused encoder writes exactly the payload that the torch-ops hash-RNG quantizer plus the wire
codec write, and decode-accumulate adds exactly Σ dequantize(decode(p))."""

import zlib

import numpy as np
import pytest
import torch
from hypothesis import assume, given, strategies as st

from dqsgd.codecs import Coding, PayloadError, decode, encode
from dqsgd.kernels import (
    HashRNG, decode_accumulate, encode_uniform_fast, quantize_uniform_fast, quantize_uniform_hash, read_header,
)
from dqsgd.kernels.fused import CHUNK
from dqsgd.quantizers.segments import segment_reduce
from dqsgd.quantizers import (
    Layout, NonFiniteGradientError, Norm, dequantize, quantize_identity, quantize_sign, quantize_ternary,
)

RNG = HashRNG(11, 5, 3)
LAYOUTS = [Layout(), Layout(bucket=100), Layout(bucket=CHUNK + 3), Layout(sizes=(3000, 1, 7006))]


def same_payload(x: torch.Tensor, bits: int, norm: Norm, layout: Layout, coding: Coding) -> bytes:
    fast = encode_uniform_fast(x, bits, RNG, norm=norm, layout=layout, coding=coding)
    ref = encode(quantize_uniform_hash(x, bits, RNG, norm=norm, layout=layout), coding)
    assert torch.equal(decode(fast).codes, decode(ref).codes)
    assert fast == ref  # zstd frames too: the same library compresses the same body the same way
    return fast


@pytest.mark.parametrize("bits", range(1, 17))
def test_fused_payload_equals_reference_at_every_width(bits: int) -> None:
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(bits))
    for layout in LAYOUTS:
        for norm in (Norm.MAX, Norm.L2):
            p = same_payload(x, bits, norm, layout, Coding.FIXED)
            q = decode(p)
            ref = quantize_uniform_hash(x, bits, RNG, norm=norm, layout=layout)
            assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales)
            assert torch.equal(dequantize(q), dequantize(ref))
    same_payload(x, bits, Norm.MAX, Layout(), Coding.ZSTD)
    same_payload(x, bits, Norm.MAX, Layout(bucket=100), Coding.ZSTD_ALIGNED)


@pytest.mark.parametrize("coding", [Coding.ELIAS, Coding.AUTO, Coding.ZSTD, Coding.ZSTD_ALIGNED, Coding.RANS, Coding.RANSX])
def test_other_codings_carry_the_same_codes(coding: Coding) -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    for bits in (2, 3, 8):
        same_payload(x, bits, Norm.L2, Layout(bucket=512), coding)


@st.composite
def vectors(draw) -> torch.Tensor:
    """Odd lengths across chunk boundaries, all-zero stretches, and hand-picked values spliced in."""
    n = draw(st.integers(0, 2 * CHUNK + 20))
    seed = draw(st.integers(0, 2**16))
    base = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * draw(st.sampled_from([0.0, 1e-3, 1.0, 1e4]))
    picks = draw(st.lists(st.one_of(st.just(0.0), st.floats(-1e3, 1e3, width=32, allow_subnormal=False)), max_size=20))
    for j, v in enumerate(picks[:n]):
        base[(j * 7919 + seed) % n] = v
    return base


@given(x=vectors(), bits=st.integers(1, 16), bucket=st.sampled_from([0, 1, 7, 64, CHUNK]),
       norm=st.sampled_from([Norm.MAX, Norm.L2]), step=st.integers(0, 2**40))
def test_property_odd_lengths_zeros_and_empty(x, bits, bucket, norm, step) -> None:
    norms = segment_reduce(x, Layout(bucket=bucket), "max_abs" if norm == Norm.MAX else "l2")
    assume(bool(((norms == 0) | (norms > 1e-30)).all()))  # s/norm must not overflow (test_tiny_norms_are_refused)
    rng = HashRNG(3, step, 1)
    fast = encode_uniform_fast(x, bits, rng, norm=norm, layout=Layout(bucket=bucket))
    assert fast == encode(quantize_uniform_hash(x, bits, rng, norm=norm, layout=Layout(bucket=bucket)))
    out = torch.full((x.numel(),), 0.25)
    decode_accumulate(fast, out, 2.0)
    assert torch.equal(out, 0.25 + 2.0 * dequantize(decode(fast)))


@pytest.mark.parametrize("bits", [1, 3, 4, 6, 11, 16])
def test_payload_and_sums_are_the_same_at_every_thread_count(bits: int) -> None:
    """The work is split over threads by chunk ranges; the bytes and the sums must not change."""
    from dqsgd.kernels import codec

    n = 70 * CHUNK * 2 + 123  # ≥ 2 threads' worth of chunks, and a short last chunk
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits))
    old, codec.MIN_CHUNKS_PER_THREAD = codec.MIN_CHUNKS_PER_THREAD, 16  # several ranges per run
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2, 5):
            torch.set_num_threads(t)
            layout = Layout(bucket=CHUNK * 3 + 5)
            p = encode_uniform_fast(x, bits, RNG, layout=layout)
            pz = encode_uniform_fast(x, bits, RNG, layout=layout, coding=Coding.ZSTD_ALIGNED)
            codes = quantize_uniform_fast(x, bits, RNG, layout=layout).codes
            out = torch.full((n,), 0.5)
            decode_accumulate(p, out, 3.0)
            decode_accumulate(pz, out, -1.0)
            results.append((p, pz, codes, out))
    finally:
        torch.set_num_threads(threads)
        codec.MIN_CHUNKS_PER_THREAD = old
    for p, pz, codes, out in results[1:]:
        assert p == results[0][0] and pz == results[0][1]
        assert torch.equal(codes, results[0][2]) and torch.equal(out, results[0][3])
    assert p == encode(quantize_uniform_hash(x, bits, RNG, layout=Layout(bucket=CHUNK * 3 + 5)))


def test_shapes_and_zero_vectors() -> None:
    x = torch.zeros(3, 5, 7)
    p = encode_uniform_fast(x, 4, RNG)
    q = decode(p)
    assert q.shape == (3, 5, 7) and not q.codes.any() and float(q.scales[0]) == 0.0
    assert decode(encode_uniform_fast(torch.zeros(0), 4, RNG)).numel == 0
    assert p == encode(quantize_uniform_hash(x, 4, RNG))


def test_decode_accumulate_equals_sum_of_dequantized_for_every_scheme() -> None:
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2001, generator=gen) for _ in range(4)]
    payloads = [encode_uniform_fast(xs[0], 5, RNG, layout=Layout(bucket=300)),
                encode(quantize_identity(xs[1])),
                encode(quantize_sign(xs[2], scaled=True, layout=Layout(sizes=(1000, 1001)))),
                encode(quantize_ternary(xs[3], torch.Generator().manual_seed(0))),
                encode_uniform_fast(xs[0], 3, RNG, coding=Coding.ELIAS),
                encode_uniform_fast(xs[1], 9, RNG, coding=Coding.ZSTD),
                encode_uniform_fast(xs[2], 6, RNG, coding=Coding.ZSTD_ALIGNED),
                encode(quantize_identity(xs[3]), Coding.ZSTD_ALIGNED),
                encode(quantize_sign(xs[2]), Coding.ELIAS),
                encode_uniform_fast(xs[3], 4, RNG, layout=Layout(bucket=500), coding=Coding.RANS),
                encode(quantize_sign(xs[1], scaled=True), Coding.RANS),
                encode(quantize_ternary(xs[0], torch.Generator().manual_seed(1)), Coding.RANS)]
    total, expected = torch.zeros(2001), torch.zeros(2001)
    for p in payloads:
        decode_accumulate(p, total)
        expected += dequantize(decode(p)).reshape(-1)
    assert torch.equal(total, expected)


def reseal(payload: bytes, at: int, value: int) -> bytes:
    """``payload`` with byte ``at`` set to ``value`` and a valid crc (a forged, not corrupted, message)."""
    b = bytearray(payload)
    b[at] = value
    b[-4:] = zlib.crc32(bytes(b[:-4])).to_bytes(4, "little")
    return bytes(b)


def test_decode_accumulate_refuses_what_decode_refuses() -> None:
    x = torch.randn(1001, generator=torch.Generator().manual_seed(4))
    good = encode_uniform_fast(x, 4, RNG)
    body = read_header(good).body_start
    forged = [good[:-1] + bytes([good[-1] ^ 1]),  # crc
              reseal(good, body, 0x00),            # code −8 < −s = −7
              reseal(good, len(good) - 5, 0xF7),   # non-zero padding bits (1001·4 bits end mid-byte)
              good[:40], b"garbage"]
    for p in forged:
        with pytest.raises(PayloadError) as ref_err:
            decode(p)
        with pytest.raises(PayloadError) as err:
            decode_accumulate(p, torch.zeros(1001))
        assert str(err.value) == str(ref_err.value)
    with pytest.raises(ValueError, match="1001 elements"):
        decode_accumulate(good, torch.zeros(1000))
    with pytest.raises(ValueError, match="float32"):
        decode_accumulate(good, torch.zeros(1001, dtype=torch.float64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_input_is_refused(bad: float) -> None:
    x = torch.randn(3 * CHUNK)
    x[2 * CHUNK + 5] = bad
    for norm in (Norm.MAX, Norm.L2):
        for layout in (Layout(), Layout(bucket=1000)):
            with pytest.raises(NonFiniteGradientError):
                encode_uniform_fast(x, 4, RNG, norm=norm, layout=layout)
            with pytest.raises(NonFiniteGradientError):
                quantize_uniform_fast(x, 4, RNG, norm=norm, layout=layout)


def test_tiny_norms_are_refused() -> None:
    x = torch.tensor([1e-38, 0.0, 1.0, 2.0])  # segment 0 has norm 1e-38: 7/1e-38 overflows float32
    with pytest.raises(ValueError, match="too small"):
        encode_uniform_fast(x, 4, RNG, layout=Layout(bucket=2))


def test_bad_arguments_are_refused() -> None:
    x = torch.randn(10)
    for bits in (0, 17):
        with pytest.raises(ValueError, match="bits"):
            encode_uniform_fast(x, bits, RNG)
    with pytest.raises(ValueError, match="norm"):
        encode_uniform_fast(x, 4, RNG, norm=Norm.L1_MEAN)
    with pytest.raises(ValueError, match="sum to"):
        encode_uniform_fast(x, 4, RNG, layout=Layout(sizes=(3, 4)))
    with pytest.raises(TypeError):
        encode_uniform_fast(torch.arange(10), 4, RNG)


def test_float64_and_noncontiguous_inputs() -> None:
    x = torch.randn(40, 30, dtype=torch.float64).t()
    assert encode_uniform_fast(x, 6, RNG) == encode(quantize_uniform_hash(x, 6, RNG))
    assert np.array_equal(RNG.uniform(5).numpy(), RNG.uniform_numpy(5))


@pytest.mark.parametrize("bits", [1, 2, 5, 9, 16])
def test_histogram_counted_while_quantizing_is_the_codes_histogram(bits: int) -> None:
    """The entropy codings' payloads count the codes in the quantizing pass (over several threads'
    ranges above 2·64 chunks): the counts are level_histogram's and the payloads the reference's."""
    from dqsgd.codecs.rans import level_histogram
    from dqsgd.kernels.codec import _quantize

    n = 2 * 64 * CHUNK + 999 if bits == 5 else 10_007
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits)) * torch.rand(n) ** 4
    q, hist = _quantize(x, bits, RNG, Norm.MAX, Layout(bucket=CHUNK + 3), histogram=True)
    assert np.array_equal(q.codes.numpy(), quantize_uniform_fast(x, bits, RNG, layout=Layout(bucket=CHUNK + 3)).codes)
    assert np.array_equal(hist, level_histogram(q.codes.numpy(), bits))
    for coding in (Coding.AUTO, Coding.RANSX, Coding.RANS):
        assert encode_uniform_fast(x, bits, RNG, layout=Layout(bucket=CHUNK + 3), coding=coding) == encode(q, coding)
    assert (encode_uniform_fast(x, bits, RNG, coding=Coding.AUTO, link_mbit=100.0)
            == encode(quantize_uniform_fast(x, bits, RNG), Coding.AUTO, link_mbit=100.0))


def test_encode_checks_the_codes_range_from_a_given_histogram() -> None:
    from dqsgd.codecs.rans import level_histogram

    q = quantize_uniform_fast(torch.randn(1000), 4, RNG)
    hist = level_histogram(q.codes.numpy(), 4)
    assert encode(q, Coding.AUTO, histogram=hist) == encode(q, Coding.AUTO)
    with pytest.raises(ValueError, match="not the level histogram"):
        encode(q, Coding.AUTO, histogram=hist[:-1])
    with pytest.raises(ValueError, match="not the level histogram"):
        encode(q, Coding.RANS, histogram=hist * 2)
    wide = hist.copy()  # the same count, one code moved to -8: outside UNIFORM's [-7, 7] at 4 bits
    wide[int(np.flatnonzero(hist)[0])] -= 1
    wide[0] += 1
    with pytest.raises(ValueError, match=r"codes span \[-8"):
        encode(q, Coding.AUTO, histogram=wide)


def test_ransx_decode_accumulate_counts_while_adding() -> None:
    """RANSX bodies: the codes are added and counted chunk by chunk (the table's check reads those
    counts); over chunk and segment edges the sum is Σ dequantize, as for every other coding."""
    n = 3 * CHUNK + 7
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 3 for _ in range(3)]
    payloads = [encode_uniform_fast(xs[0], 6, RNG, layout=Layout(sizes=(5, CHUNK - 1, 2 * CHUNK + 3)),
                                    coding=Coding.RANSX),
                encode_uniform_fast(xs[1], 2, RNG, layout=Layout(bucket=1000), coding=Coding.RANSX),
                encode(quantize_sign(xs[2], scaled=True), Coding.RANSX),
                encode_uniform_fast(xs[2], 1, RNG, coding=Coding.RANSX)]
    total, expected = torch.zeros(n), torch.zeros(n)
    for p in payloads:
        assert read_header(p).coding == Coding.RANSX
        decode_accumulate(p, total, 0.5)
        expected += 0.5 * dequantize(decode(p)).reshape(-1)
    assert torch.equal(total, expected)
