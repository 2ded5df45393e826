"""The batched codec (:mod:`dqsgd.kernels.batch`) writes every shard's payload byte for byte as the
one-payload codec does, and adds a batch of payloads bit for bit as adding them one by one does."""

import numpy as np
import pytest
import torch

from dqsgd.codecs import PayloadError
from dqsgd.core.sharding import shard_bounds, shard_sizes
from dqsgd.kernels import HashRNG
from dqsgd.kernels.batch import decode_batch, encode_batch
from dqsgd.kernels.codec import fixed_plan
from dqsgd.quantizers import Layout, NonFiniteGradientError, Norm

PARAMS = (300, 7, 1000, 211)


def spec_of(n: int, shards: int, case: int) -> tuple:
    """The shards of a vector of n coordinates, their layouts: one norm, buckets of 97, per tensor."""
    out = []
    for lo, hi in shard_bounds(n, shards):
        layout = (Layout(), Layout(bucket=97), Layout(sizes=tuple(shard_sizes(PARAMS, lo, hi))))[case]
        out.append((hi - lo, layout))
    return tuple(out)


def keys(shards: int, worker: int = 1) -> list[int]:
    return [HashRNG(5, 3, worker * shards + j).key for j in range(shards)]


@pytest.mark.parametrize("case", [0, 1, 2])
@pytest.mark.parametrize("bits", [1, 3, 4, 8, 13])
@pytest.mark.parametrize("norm", [Norm.MAX, Norm.L2])
@pytest.mark.parametrize("gap", [0, 1])
def test_encode_is_the_shards_payloads(case: int, bits: int, norm: Norm, gap: int) -> None:
    n, shards = sum(PARAMS), 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits))
    spec = spec_of(n, shards, case)
    b = encode_batch(spec, bits, norm, gap)
    buf = b.encode(x, keys(shards)).numpy()
    assert buf.size == b.total == sum(b.sizes) + gap * shards
    for j, ((numel, layout), at, lo) in enumerate(zip(spec, b.offsets, b.out_at)):
        plan = fixed_plan(numel, bits, norm, layout)
        want = np.empty(plan.size, dtype=np.uint8)
        plan.encode_into(x[lo : lo + numel], HashRNG(5, 3, shards + j), want)
        assert buf[at : at + plan.size].tobytes() == want.tobytes()
        assert buf[at + plan.size : at + plan.size + gap].tolist() == [0] * gap


@pytest.mark.parametrize("case", [0, 1, 2])
@pytest.mark.parametrize("bits", [1, 4, 11])
def test_accumulate_is_the_sequential_sum(case: int, bits: int) -> None:
    """The W payloads of one shard (at W offsets of one buffer, one slice of out), and the S shards of a
    downlink (each at its own slice), added as the one-payload decoder adds them one by one."""
    n, workers = sum(PARAMS), 4
    spec = spec_of(n, workers, case)
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(w)) * (w + 1) for w in range(workers)]
    rows = [encode_batch(spec, bits, Norm.MAX, 1).encode(x, keys(workers, w)) for w, x in enumerate(xs)]
    # uplink: shard 2's payload from every worker
    b0 = encode_batch(spec, bits, Norm.MAX, 1)
    j, size = 2, b0.sizes[2]
    recv = torch.cat([r[b0.offsets[j] : b0.offsets[j] + size + 1] for r in rows])
    numel, layout = spec[j]
    got, want = torch.zeros(numel), torch.zeros(numel)
    dec = decode_batch((spec[j],) * workers, bits, Norm.MAX, tuple(w * (size + 1) for w in range(workers)),
                       (0,) * workers)
    assert dec.accumulate(recv, got, 0.25) is None
    plan = fixed_plan(numel, bits, Norm.MAX, layout)
    for w in range(workers):
        plan.accumulate(recv[w * (size + 1) : w * (size + 1) + size].numpy(), want, 0.25)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # downlink: every shard's payload of row 0 into its own slice
    got, want = torch.zeros(n), torch.zeros(n)
    assert decode_batch(spec, bits, Norm.MAX, b0.offsets, b0.out_at).accumulate(rows[0], got) is None
    for (numel, layout), at, lo in zip(spec, b0.offsets, b0.out_at):
        p = fixed_plan(numel, bits, Norm.MAX, layout)
        p.accumulate(rows[0][at : at + p.size].numpy(), want[lo : lo + numel])
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("where", ["head", "scale", "body", "crc", "pad", "code", "beyond"])
def test_a_bad_payload_is_named(where: str) -> None:
    """A payload that the one-payload decoder refuses is the index the batch returns; every check but
    the code range is made before anything is added. "beyond": a finite scale whose weighted top value
    is not a finite float32 (the finite-output rule)."""
    spec, bits = spec_of(1001, 1, 0) * 3, 3
    b = encode_batch(spec[:1], bits, Norm.MAX)
    p = b.encode(torch.randn(1001), keys(1))
    size = p.numel()
    buf = torch.cat([p, p, p]).numpy().copy()
    plan = b.plans[0]
    w = 2.0 if where == "beyond" else 1.0
    at = size + {"beyond": plan.scales_at + 3, "head": 1, "scale": plan.scales_at + 3, "body": plan.head_len + 5, "crc": size - 1,
                 "pad": plan.head_len + plan.body_len - 1, "code": plan.head_len}[where]
    if where in ("scale", "beyond"):
        bad = np.inf if where == "scale" else 3e38  # 2·(3·3e38/3) overflows float32
        buf[at - 3 : at + 1] = np.frombuffer(np.float32(bad).tobytes(), np.uint8)
    elif where == "pad":
        buf[at] |= 0x80
    elif where == "code":  # 3 bits, 3 levels: the code 0b000 (-4) is out of range [-3, 3]
        buf[at] = 0
    else:
        buf[at] ^= 0x10
    if where in ("scale", "pad", "code", "beyond"):  # the crc is right: only the named check fails
        from dqsgd.codecs.threads import crc32

        buf[2 * size - 4 : 2 * size] = np.array([crc32(buf[size : 2 * size - 4])], "<u4").view(np.uint8)
    with pytest.raises(PayloadError):
        plan.accumulate(buf[size : 2 * size], torch.zeros(1001), w)
    out = torch.zeros(1001)
    dec = decode_batch(spec, bits, Norm.MAX, (0, size, 2 * size), (0, 0, 0))
    assert dec.accumulate(torch.from_numpy(buf), out, w) == 1
    if where != "code":
        assert not out.any()


def test_a_nonfinite_shard_is_named() -> None:
    x = torch.randn(1000)
    x[700] = float("nan")
    b = encode_batch(spec_of(1000, 4, 0), 4, Norm.MAX)
    with pytest.raises(NonFiniteGradientError) as e:
        b.encode(x, keys(4))
    assert e.value.shard == 2
