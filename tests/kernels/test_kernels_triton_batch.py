"""The Triton batch (:mod:`dqsgd.kernels.triton_batch`) writes the CPU batch's bytes and sums, flags a
bad payload, and issues per bucket a number of launches and torch ops that does not grow with the
number of shards: run on the CPU through Triton's interpreter (see test_kernels_triton)."""

import os
from pathlib import Path

import pytest
import torch

if os.environ.get("DQSGD_TRITON_TEST_DEVICE", "cpu") != "cpu":
    pytest.skip("run on the CPU through Triton's interpreter", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
pytest.importorskip("triton", reason="the triton package (the 'gpu' extra) is not installed")

from dqsgd.kernels import HashRNG, device_common  # noqa: E402
from dqsgd.kernels.batch import decode_batch, encode_batch  # noqa: E402
from dqsgd.kernels.triton_batch import accumulate_batch_triton, encode_batch_triton  # noqa: E402
from dqsgd.quantizers import Layout, Norm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SPECS = {"one": ((700, Layout()), (701, Layout())), "bucket": ((700, Layout(bucket=97)), (701, Layout(bucket=97))),
         "tensors": ((700, Layout(sizes=(300, 0, 400))), (701, Layout(sizes=(200, 501))))}


@pytest.fixture(autouse=True)
def triton_on_cpu():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was set up for a GPU (TRITON_INTERPRET unset)")
    device_common.set_triton(True)
    yield
    device_common.set_triton(None)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.slow  # the interpreter: a few seconds per case
@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("bits", [1, 4, 11])
def test_triton_batch_is_the_cpu_batch(kind: str, bits: int) -> None:
    spec = SPECS[kind]
    n = sum(m for m, _ in spec)
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits)) * 3
    keys = [HashRNG(1, 2, j).key for j in range(len(spec))]
    b = encode_batch(spec, bits, Norm.MAX, 1)
    cpu, tri = b.encode(x, keys), encode_batch_triton(b, x, keys)
    assert torch.equal(cpu, tri)
    bad = torch.zeros((), dtype=torch.bool)
    for dec, size in ((decode_batch(spec, bits, Norm.MAX, b.offsets, b.out_at), n),  # the downlink's form
                      (decode_batch((spec[0],) * 3, bits, Norm.MAX, (b.offsets[0],) * 3, (0, 0, 0)), spec[0][0])):
        want, got = torch.zeros(size), torch.zeros(size)
        assert dec.accumulate(cpu, want, 0.5) is None
        accumulate_batch_triton(dec, tri, got, 0.5, bad)
        assert bitwise(got, want) and not bool(bad)
    for at in (5, b.offsets[1] + b.sizes[1] - 1, b.offsets[1] + b.plans[1].head_len + 3):  # header, crc, body
        broken = tri.clone()
        broken[at] ^= 0x40
        flag = torch.zeros((), dtype=torch.bool)
        accumulate_batch_triton(decode_batch(spec, bits, Norm.MAX, b.offsets, b.out_at), broken, torch.zeros(n), 1.0,
                                flag)
        assert bool(flag), at


@pytest.mark.slow  # the interpreter and the profiler: about a minute
def test_one_bucket_issues_the_same_launches_and_ops_at_every_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """One sharded bucket's codec calls on one rank (uplink encode of the W shards, decode-and-average
    of the W payloads of its shard, its downlink encode, the decode of the W downlink payloads): the
    same Triton launches, kernel-launching aten ops and aten ops at W = 2, 4, 8 and 16 (one call per
    pass, whatever W). One call per shard issued 5 launches per encode + decode pair, W of them."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_call_cost import count_bucket

    want = {"_absmax_batch": 1, "_crc_batch": 3, "_decode_batch": 2, "_encode_batch": 1,  # the batched passes
            "_absmax_kernel": 1, "_crc_level": 1, "_encode_kernel": 1}  # the one downlink payload this rank encodes
    for workers in (2, 4, 8, 16):
        c = count_bucket(1024, workers, repeat=1)
        assert not c["bad"]
        assert c["by_kernel"] == want, (workers, c["by_kernel"])
        # the encode's key table is on the device (split_keys): no copy of it per call (was 13 and 64);
        # the scratch buffers come from the bucket's workspace (dqsgd.kernels.workspace): no allocation (was 59);
        # the uplink's send buffer is not zero-filled (the crc's last level zeroes its gap bytes): 11 (was 12);
        # each encode writes the step's key into its device tensor (one fill_ each, so that a CUDA graph of the
        # calls replays at every step: +2), and both decodes write their outputs without reading them, so
        # nothing zero-fills them first (-2, and the zeros' own ops): 11 and 41 (were 11 and 44)
        assert (c["aten_kernels"], c["aten_ops"]) == (11, 41), (workers, c["by_op"], c["aten_ops"])
        assert c["by_op"]["aten::fill_"] == 2, c["by_op"]
