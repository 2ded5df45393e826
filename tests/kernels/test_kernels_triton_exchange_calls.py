"""The exchange's codec calls on the Triton path, as a CUDA graph replays them and as few passes as they can
be. Run on the CPU through Triton's interpreter (see test_kernels_triton; with
``DQSGD_TRITON_TEST_DEVICE=cuda``, as ``benchmarks/gpu_check.sh`` runs it, compiled on the GPU).

* The step's key in a device tensor (``workspace.step_key``): the encode kernels read the HashRNG key
  from a 1-element int64 tensor, so calls made with the same arguments and buffers at every step (what
  a CUDA graph captured once replays) write each step's bytes once the caller has written that step's
  key into the tensor (``workspace.write_key``): the bytes equal the eager calls' with each step's key,
  and numba's.
* The batched decode sums the payloads of one place in registers and writes the sum once
  (``triton_batch._decode_batch``); with ``fresh`` it does not read ``out`` at all: the sums are the
  CPU batch's bit for bit (one add per payload, in payload order), and ``fresh`` gives what a zeroed
  ``out`` gives whatever ``out`` held before (NaN included: it is not read)."""

import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("DQSGD_TRITON_TEST_DEVICE", "cpu"))  # cuda: compiled (benchmarks/gpu_check.sh)
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
elif not torch.cuda.is_available():
    pytest.skip(f"DQSGD_TRITON_TEST_DEVICE={DEVICE}, but CUDA is not available", allow_module_level=True)
pytest.importorskip("triton", reason="the triton package (the 'gpu' extra) is not installed")

from dqsgd.codecs import Coding  # noqa: E402
from dqsgd.kernels import HashRNG, encode_uniform_fast, workspace  # noqa: E402
from dqsgd.kernels.batch import decode_batch, encode_batch  # noqa: E402
from dqsgd.kernels.device import encode_uniform_device  # noqa: E402
from dqsgd.kernels.triton_batch import accumulate_batch_triton, encode_batch_triton, split_keys  # noqa: E402
from dqsgd.quantizers import Layout, Norm  # noqa: E402

SPEC = ((700, Layout(bucket=97)), (701, Layout(bucket=97)), (650, Layout(bucket=97)))
SPEC3 = ((700, Layout(bucket=97)), (701, Layout(bucket=97)), (1500, Layout(bucket=97)))


pytestmark = pytest.mark.usefixtures("triton_kernels")  # tests/kernels/conftest.py


def uplink_keys(step: int) -> list[int]:
    return [HashRNG(5, step, 3 * len(SPEC) + j).key for j in range(len(SPEC))]  # rank 3's shards


@pytest.mark.slow  # the interpreter: a few seconds
@pytest.mark.parametrize("bits", [1, 4, 11])
def test_same_call_every_step_with_the_key_tensor_written_in_place(bits: int) -> None:
    n = sum(m for m, _ in SPEC)
    xc = torch.randn(n, generator=torch.Generator().manual_seed(bits)) * 3
    x, b = xc.to(DEVICE), encode_batch(SPEC, bits, Norm.MAX, 1)
    avg = x[: SPEC[0][0]].clone()
    up, down = (torch.zeros(1, dtype=torch.int64, device=DEVICE) for _ in range(2))
    ws: dict = {}

    def captured() -> tuple[torch.Tensor, torch.Tensor]:
        """The calls as a graph would hold them: step 0's arguments, the same buffers; only the tensors' keys move."""
        with workspace.use(ws):
            return (encode_batch_triton(b, x, uplink_keys(0), key=up),
                    encode_uniform_device(avg, bits, HashRNG(9, 0, 2), layout=Layout(bucket=97), check="defer",
                                          key=down))

    seen = set()
    for step in (1, 2, 7):
        workspace.write_key(up, split_keys(uplink_keys(step))[0])
        workspace.write_key(down, HashRNG(9, step, 2).key)
        sent, pay = captured()
        eager = encode_batch_triton(b, x, uplink_keys(step))  # its own buffers, the key written by the call
        assert torch.equal(sent, eager), step
        assert torch.equal(sent.cpu(), b.encode(xc, uplink_keys(step))), step  # numba
        rng = HashRNG(9, step, 2)
        assert torch.equal(pay, encode_uniform_device(avg, bits, rng, layout=Layout(bucket=97), check="defer")), step
        want = encode_uniform_fast(avg.cpu(), bits, rng, layout=Layout(bucket=97), coding=Coding.FIXED)
        assert bytes(pay.cpu().numpy()) == want, step
        seen.add((bytes(sent.cpu().numpy()), bytes(pay.cpu().numpy())))
    assert len(seen) == 3  # each step its own uniforms: the key is what moved


def test_a_key_tensor_of_the_wrong_kind_is_refused() -> None:
    x = torch.randn(100, device=DEVICE)
    for bad in (torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)):
        with pytest.raises(ValueError, match="1-element int64"):
            encode_uniform_device(x, 4, HashRNG(1, 2, 3), key=bad)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.slow  # the interpreter: a few seconds per case
@pytest.mark.parametrize("bits", [2, 4, 9])
def test_the_sum_of_one_place_is_the_cpu_batch_and_fresh_reads_nothing(bits: int) -> None:
    n = sum(m for m, _ in SPEC3)
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits)) * 3
    b = encode_batch(SPEC3, bits, Norm.MAX, 1)
    sent = encode_batch_triton(b, x.to(DEVICE), [HashRNG(1, 2, j).key for j in range(len(SPEC3))])
    assert torch.equal(sent.cpu(), b.encode(x, [HashRNG(1, 2, j).key for j in range(len(SPEC3))]))
    sent_cpu = sent.cpu()
    order = (0, 2, 1, 2, 0)  # five payloads of unequal lengths at one place (1500 coordinates), then S places
    cases = {"one place": (decode_batch(tuple(SPEC3[p] for p in order), bits, Norm.MAX,
                                        tuple(b.offsets[p] for p in order), (0,) * len(order)), 1500, 1 / 5),
             "S places": (decode_batch(SPEC3, bits, Norm.MAX, b.offsets, b.out_at), n, 1.0)}
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
