"""The batched decode sums the payloads of one place in registers and writes the sum once
(``triton_batch._decode_batch``); with ``fresh`` it does not read ``out`` at all. Run on the CPU through
Triton's interpreter (see test_kernels_triton; with ``DQSGD_TRITON_TEST_DEVICE=cuda``, as
``benchmarks/gpu_check.sh`` runs it, compiled on the GPU): the sums are the CPU batch's bit for bit (one add per
payload, in payload order), and ``fresh`` gives what a zeroed ``out`` gives whatever ``out`` held
before (NaN included: it is not read)."""

import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("DQSGD_TRITON_TEST_DEVICE", "cpu"))  # cuda: compiled (benchmarks/gpu_check.sh)
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
elif not torch.cuda.is_available():
    pytest.skip(f"DQSGD_TRITON_TEST_DEVICE={DEVICE}, but CUDA is not available", allow_module_level=True)
pytest.importorskip("triton", reason="the triton package (the 'gpu' extra) is not installed")

from dqsgd.kernels import HashRNG, device_common  # noqa: E402
from dqsgd.kernels.batch import decode_batch, encode_batch  # noqa: E402
from dqsgd.kernels.triton_batch import accumulate_batch_triton, encode_batch_triton  # noqa: E402
from dqsgd.quantizers import Layout, Norm  # noqa: E402

SPEC = ((700, Layout(bucket=97)), (701, Layout(bucket=97)), (1500, Layout(bucket=97)))


@pytest.fixture(autouse=True)
def triton_on_cpu():
    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was set up for a GPU (TRITON_INTERPRET unset)")
    device_common.set_triton(True)
    yield
    device_common.set_triton(None)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.slow  # the interpreter: a few seconds per case
@pytest.mark.parametrize("bits", [2, 4, 9])
def test_the_sum_of_one_place_is_the_cpu_batch_and_fresh_reads_nothing(bits: int) -> None:
    n = sum(m for m, _ in SPEC)
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits)) * 3
    b = encode_batch(SPEC, bits, Norm.MAX, 1)
    sent = encode_batch_triton(b, x.to(DEVICE), [HashRNG(1, 2, j).key for j in range(len(SPEC))])
    assert torch.equal(sent.cpu(), b.encode(x, [HashRNG(1, 2, j).key for j in range(len(SPEC))]))
    sent_cpu = sent.cpu()
    order = (0, 2, 1, 2, 0)  # five payloads of unequal lengths at one place (1500 coordinates), then S places
    cases = {"one place": (decode_batch(tuple(SPEC[p] for p in order), bits, Norm.MAX,
                                        tuple(b.offsets[p] for p in order), (0,) * len(order)), 1500, 1 / 5),
             "S places": (decode_batch(SPEC, bits, Norm.MAX, b.offsets, b.out_at), n, 1.0)}
    for name, (dec, size, w) in cases.items():
        start = torch.randn(size, generator=torch.Generator().manual_seed(7))
        start[::5] = -0.0
        want, got, bad = start.clone(), start.to(DEVICE), torch.zeros((), dtype=torch.bool, device=DEVICE)
        assert dec.accumulate(sent_cpu, want, w) is None
        accumulate_batch_triton(dec, sent, got, w, bad)
        assert bitwise(got.cpu(), want) and not bool(bad), name
        want, got = torch.zeros(size), torch.full((size,), float("nan"), device=DEVICE)
        assert dec.accumulate(sent_cpu, want, w) is None
        accumulate_batch_triton(dec, sent, got, w, bad, fresh=True)
        assert bitwise(got.cpu(), want) and not bool(bad), name
