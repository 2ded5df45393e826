"""FixedPlan writes the bytes of encode_uniform_fast into a caller's buffer and decodes them to the
bits of decode_accumulate; payloads that are not what the plan expects are refused."""

import zlib

import numpy as np
import pytest
import torch

from dqsgd.codecs import PayloadError
from dqsgd.core.sharding import shard_bounds
from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast
from dqsgd.kernels.codec import FixedPlan, fixed_plan, inverse_norms
from dqsgd.kernels.fused import CHUNK
from dqsgd.quantizers import Layout, NonFiniteGradientError, Norm, levels_for_bits

LAYOUTS = [Layout(), Layout(bucket=100), Layout(bucket=CHUNK + 3)]


def planned(x: torch.Tensor, bits: int, rng: HashRNG, norm: Norm, layout: Layout) -> np.ndarray:
    """The plan's payload, written into a buffer with junk around it (nothing outside is touched)."""
    plan = fixed_plan(x.numel(), bits, norm, layout)
    buf = np.full(plan.size + 6, 0xA5, dtype=np.uint8)
    plan.encode_into(x, rng, buf[3:-3])
    assert (buf[:3] == 0xA5).all() and (buf[-3:] == 0xA5).all()
    return buf[3:-3]


def check_same(x: torch.Tensor, bits: int, rng: HashRNG, norm: Norm, layout: Layout) -> np.ndarray:
    ref = encode_uniform_fast(x, bits, rng, norm=norm, layout=layout)
    mine = planned(x, bits, rng, norm, layout)
    assert mine.tobytes() == ref
    want, got = torch.full((x.numel(),), 0.25), torch.full((x.numel(),), 0.25)
    decode_accumulate(ref, want, 0.5)
    h = fixed_plan(x.numel(), bits, norm, layout).accumulate(mine, got, 0.5)
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))  # bit for bit
    assert h.numel == x.numel() and h.bits == bits and h.norm == norm and h.layout == layout
    return mine


@pytest.mark.parametrize("bits", range(1, 17))
@pytest.mark.parametrize("world", [1, 3, 8])
def test_every_shard_payload_is_encode_uniform_fast_byte_for_byte(bits: int, world: int) -> None:
    """Shards of buckets not divisible by W, 0- and 1-element shards, every width, both norms, layouts, seeds."""
    for n in (0, 1, world - 1, 7 * world + 5, 2 * CHUNK + 11):
        g = torch.randn(n, generator=torch.Generator().manual_seed(n * 31 + bits)) * 3.0
        for j, (lo, hi) in enumerate(shard_bounds(n, world)):
            for norm in (Norm.MAX, Norm.L2):
                for layout in LAYOUTS:
                    for seed in (0, 12345):
                        check_same(g[lo:hi], bits, HashRNG(seed, n, j), norm, layout)


@pytest.mark.parametrize("layout", [Layout(sizes=(500, 0, 1, 2000)), Layout(sizes=(2501,))])
def test_explicit_sizes_layouts(layout: Layout) -> None:
    x = torch.randn(2501, generator=torch.Generator().manual_seed(5))
    for bits in (2, 5, 8, 16):
        check_same(x, bits, HashRNG(3, 4, 5), Norm.MAX, layout)
        check_same(x, bits, HashRNG(3, 4, 5), Norm.L2, layout)


def test_zero_segments_and_multithreaded_sizes() -> None:
    x = torch.randn(300 * CHUNK + 17, generator=torch.Generator().manual_seed(9))
    x[:CHUNK + 3] = 0  # a zero segment: inv 0, codes 0
    torch.set_num_threads(2)
    try:
        for layout in (Layout(), Layout(bucket=CHUNK)):
            check_same(x, 4, HashRNG(1, 2, 3), Norm.MAX, layout)
    finally:
        torch.set_num_threads(1)
    check_same(torch.zeros(10), 3, HashRNG(1, 2, 3), Norm.MAX, Layout())


def test_inverse_norms_equal_torchs_expression_bitwise() -> None:
    """torch.where(sc > 0, s / sc, 0) over float32 norms of every exponent, subnormals included."""
    bits = np.random.default_rng(0).integers(0, 0x7F800000, 200_000, dtype=np.int64).astype(np.uint32)
    sc = np.concatenate([bits.view(np.float32), np.float32([0.0, 1e-38, 3e38, 1.0, 7.0])])
    for b in (1, 2, 4, 8, 15, 16):
        s = levels_for_bits(b)
        t = torch.from_numpy(sc)
        with np.errstate(over="ignore"):
            want = torch.where(t > 0, s / t, torch.zeros_like(t)).numpy()
        ok = np.isfinite(want)
        got = inverse_norms(sc[ok], s)
        assert np.array_equal(got.view(np.uint32), want[ok].view(np.uint32))
        with pytest.raises(ValueError, match="too small"):
            inverse_norms(sc, s)  # the tiny norms whose s/norm overflows are refused
        for bad in (np.nan, np.inf):
            with pytest.raises(NonFiniteGradientError):
                inverse_norms(np.float32([1.0, bad]), s)


def test_numpy_steps_equal_torchs_bitwise() -> None:
    """The decoder's step scale/levels: numpy's float32 division gives torch's floats (``_steps``)."""
    bits = np.random.default_rng(1).integers(0, 0x7F800000, 200_000, dtype=np.int64).astype(np.uint32)
    sc = bits.view(np.float32)
    for b in range(1, 17):
        s = levels_for_bits(b)
        want = (torch.from_numpy(sc).to(torch.float32) / float(s)).numpy()
        assert np.array_equal((sc / np.float32(s)).view(np.uint32), want.view(np.uint32))


def test_non_finite_input_is_refused() -> None:
    x = torch.randn(100)
    x[7] = float("nan")
    plan = fixed_plan(100, 4, Norm.MAX, Layout())
    for norm in (Norm.MAX, Norm.L2):
        with pytest.raises(NonFiniteGradientError):
            fixed_plan(100, 4, norm, Layout()).encode_into(x, HashRNG(0, 0, 0), np.empty(plan.size, np.uint8))


def test_wrong_arguments_are_refused() -> None:
    plan = fixed_plan(100, 4, Norm.MAX, Layout())
    with pytest.raises(ValueError, match="uint8 array"):
        plan.encode_into(torch.randn(100), HashRNG(0, 0, 0), np.empty(plan.size - 1, np.uint8))
    with pytest.raises(ValueError, match="float32 CPU tensor"):
        plan.encode_into(torch.randn(99), HashRNG(0, 0, 0), np.empty(plan.size, np.uint8))
    with pytest.raises(ValueError, match="norm"):
        FixedPlan(100, 4, Norm.NONE, Layout())
    with pytest.raises(ValueError, match="bits"):
        FixedPlan(100, 17, Norm.MAX, Layout())


def _recrc(p: np.ndarray) -> np.ndarray:
    p[-4:] = np.array([zlib.crc32(p[:-4].tobytes())], dtype="<u4").view(np.uint8)
    return p


def _refused(p: np.ndarray, match: str, plan: FixedPlan) -> None:
    with pytest.raises(PayloadError, match=match):
        plan.accumulate(p, torch.zeros(plan.numel))
    with pytest.raises(PayloadError, match=match):  # the parsing decoder refuses it too
        decode_accumulate(p.tobytes(), torch.zeros(plan.numel))


def test_corrupted_payloads_are_refused() -> None:
    n, bits = 1001, 2  # 1001·2 bits: 6 padding bits in the last byte; levels 1: code -2 is out of range
    plan = fixed_plan(n, bits, Norm.MAX, Layout())
    good = planned(torch.randn(n), bits, HashRNG(0, 0, 0), Norm.MAX, Layout())
    for at in (0, 3, plan.scales_at, plan.head_len - 1, plan.head_len + 5, plan.size - 1):
        p = good.copy()
        p[at] ^= 0x10
        with pytest.raises(PayloadError):
            plan.accumulate(p, torch.zeros(n))
    p = good.copy()
    p[plan.head_len + 5] ^= 0x10
    _refused(p, "crc mismatch", plan)
    p = good.copy()
    p[0] = ord("X")
    _refused(p, "not a dqsgd payload", plan)
    _refused(good[:-1].copy(), "truncated", plan)
    _refused(np.concatenate([good, np.zeros(1, np.uint8)]), "extra bytes", plan)
    p = good.copy()
    p[plan.scales_at : plan.scales_at + 4] = np.float32([np.inf]).view(np.uint8)
    _refused(_recrc(p), "non-finite scale", plan)
    p = good.copy()
    p[plan.size - 5] |= 0x80
    _refused(_recrc(p), "padding bits", plan)
    p = good.copy()
    p[plan.head_len] = 0  # offset binary 0 = code -2, outside [-1, 1]
    _refused(_recrc(p), "codes span", plan)


def test_a_valid_payload_of_other_parameters_is_refused() -> None:
    plan = fixed_plan(100, 4, Norm.MAX, Layout())
    x = torch.randn(100)
    for other in (encode_uniform_fast(x, 5, HashRNG(0, 0, 0)),
                  encode_uniform_fast(x, 4, HashRNG(0, 0, 0), norm=Norm.L2),
                  encode_uniform_fast(x, 4, HashRNG(0, 0, 0), layout=Layout(bucket=10))):
        p = np.frombuffer(other, dtype=np.uint8)
        assert not plan.matches(p)
        with pytest.raises(PayloadError, match="expected a uniform FIXED payload of 100 values at 4 bits"):
            plan.accumulate(p, torch.zeros(100))
    with pytest.raises(PayloadError, match="caller expects|more than max_numel|truncated"):
        plan.accumulate(np.frombuffer(encode_uniform_fast(torch.randn(101), 4, HashRNG(0, 0, 0)), np.uint8),
                        torch.zeros(100))
