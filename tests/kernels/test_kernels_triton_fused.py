"""The crc's level 0 computed inside the encode kernels (``triton_crc.crc_scatter``): each encode
program XORs the level-0 raws of the bytes it has just written into the tree's first level, so the
crc reads no payload byte again. Checked through Triton's interpreter on CPU tensors (see
test_kernels_triton): payloads that span several 2 KiB blocks of the tree, with encode programs and
header programs straddling block boundaries, are byte for byte the numba kernels' (whose crc is
zlib's), one payload and batched; and the encode issues no level-0 crc launch. On a GPU
(``DQSGD_TRITON_TEST_DEVICE=cuda``, as ``benchmarks/gpu_check.sh`` runs it) the byte tests run the
compiled kernels on CUDA tensors (the atomics of real concurrent programs); the references stay the
numba kernels on the CPU."""

import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

DEVICE = torch.device(os.environ.get("DQSGD_TRITON_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
elif not torch.cuda.is_available():
    pytest.skip(f"DQSGD_TRITON_TEST_DEVICE={DEVICE}, but CUDA is not available", allow_module_level=True)
pytest.importorskip("triton", reason="the triton package (the 'gpu' extra) is not installed")

from dqsgd.codecs import Coding  # noqa: E402
from dqsgd.kernels import HashRNG, encode_uniform_fast  # noqa: E402
from dqsgd.kernels.batch import encode_batch  # noqa: E402
from dqsgd.kernels.device import encode_uniform_device  # noqa: E402
from dqsgd.kernels.triton_batch import encode_batch_triton  # noqa: E402
from dqsgd.kernels.triton_crc import BLOCK0, _crc_level, block_table  # noqa: E402
from dqsgd.quantizers import Layout, Norm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RNG = HashRNG(11, 4, 2)


pytestmark = pytest.mark.usefixtures("triton_kernels")  # tests/kernels/conftest.py


def test_block_table_is_the_raw_of_one_byte_in_a_block() -> None:
    """TB[o][b] = raw crc (register from 0, no final xor) of a 2 KiB block zero but for b at o, i.e.
    zlib.crc32(block) ⊕ zlib.crc32(zero block)."""
    tb = block_table()
    zero = zlib.crc32(bytes(BLOCK0))
    for o, b in ((0, 1), (255, 0x80), (256, 7), (1000, 0xFF), (BLOCK0 - 1, 0x5A)):
        block = bytearray(BLOCK0)
        block[o] = b
        assert int(np.uint32(tb[o, b])) == zlib.crc32(bytes(block)) ^ zero, (o, b)
    assert not tb[:, 0].any()


@pytest.mark.slow  # the interpreter: a few seconds per case
@pytest.mark.parametrize("bits,n,layout", [
    (1, 40_001, Layout(bucket=4096)),  # 128-byte programs, 3 blocks
    (3, 9_001, Layout(sizes=tuple([20] * 400) + (1001,))),  # a 1.6 KiB header: two header programs
    (7, 5_003, Layout(bucket=97)),  # 896-byte programs straddling blocks
    (16, 3_001, Layout()),  # 2 KiB programs: each in exactly two blocks
])
def test_fused_crc_payload_is_numbas_across_blocks(bits: int, n: int, layout: Layout) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits)) * 2
    for norm in (Norm.MAX, Norm.L2):
        p = bytes(encode_uniform_device(x.to(DEVICE), bits, RNG, norm=norm, layout=layout).cpu().numpy())
        assert len(p) > 2 * BLOCK0
        assert zlib.crc32(p[:-4]) == int.from_bytes(p[-4:], "little")
        if norm == Norm.MAX or DEVICE.type == "cpu":  # a GPU's l2 norm sums in its own order
            assert p == encode_uniform_fast(x, bits, RNG, norm=norm, layout=layout, coding=Coding.FIXED), norm


@pytest.mark.slow  # the interpreter: a few seconds
@pytest.mark.parametrize("norm", [Norm.MAX, Norm.L2])
def test_fused_crc_batch_of_unequal_payloads_is_the_cpu_batch(norm: Norm) -> None:
    """Three payloads of different lengths, each padded in front to the longest's blocks."""
    spec = ((7000, Layout(bucket=97)), (3001, Layout(bucket=97)), (9000, Layout(bucket=97)))
    x = torch.randn(sum(m for m, _ in spec), generator=torch.Generator().manual_seed(3)) * 3
    keys = [HashRNG(1, 2, j).key for j in range(len(spec))]
    b = encode_batch(spec, 5, norm, 1)
    got = encode_batch_triton(b, x.to(DEVICE), keys).cpu()
    if norm == Norm.MAX or DEVICE.type == "cpu":  # a GPU's l2 norm sums in its own order
        assert torch.equal(got, b.encode(x, keys))
    for at, size in zip(b.offsets, b.sizes):
        p = bytes(got[at : at + size].numpy())
        assert zlib.crc32(p[:-4]) == int.from_bytes(p[-4:], "little")


@pytest.mark.slow  # the interpreter: a few seconds
def test_encode_reads_no_payload_byte_for_its_crc(monkeypatch: pytest.MonkeyPatch) -> None:
    """A payload of several blocks: the encode launches the tree from level 1 only (one launch here:
    10 blocks), never the level-0 kernel that reads the bytes again (before: level 0, then level 1)."""
    if DEVICE.type != "cpu":
        pytest.skip("counted through the interpreter")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_call_cost import _counting

    launches: dict[str, int] = {}
    levels = []
    real = _crc_level.run

    def run(*args, **kw):  # the LOOKUPS of each crc launch: 1 = level 0 (reads bytes), 4 = above
        levels.append(kw["LOOKUPS"])
        return real(*args, **kw)

    monkeypatch.setattr(_crc_level, "run", run)
    with _counting(launches):
        p = encode_uniform_device(torch.randn(40_000), 4, RNG, check="defer")
    assert p.numel() > 9 * BLOCK0
    assert levels == [4], levels
    assert launches == {"_absmax_kernel": 1, "_encode_kernel": 1, "_crc_level": 1}, launches


@pytest.mark.slow  # the interpreter: a few seconds
@pytest.mark.parametrize("gap", [1, 3])
def test_batch_buffer_needs_no_zero_fill(gap: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched encode's buffer is made without a zero fill: the kernels write every byte of every
    payload and the crc's last level zeroes the gap bytes after each (the hook's flag byte), so
    whatever the allocator hands back, the bytes are the CPU batch's."""
    spec = ((2000, Layout(bucket=97)), (3001, Layout(bucket=97)))
    x = torch.randn(5001, generator=torch.Generator().manual_seed(gap)) * 3
    keys = [HashRNG(1, 2, j).key for j in range(len(spec))]
    b = encode_batch(spec, 4, Norm.MAX, gap)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(0xA5) if k.get("dtype") == torch.uint8
                        else empty(*a, **k))
    got = encode_batch_triton(b, x.to(DEVICE), keys).cpu()
    monkeypatch.undo()
    assert torch.equal(got, b.encode(x, keys))
