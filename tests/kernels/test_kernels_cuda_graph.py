"""On a GPU (``benchmarks/gpu_check.sh`` runs it; skipped elsewhere): one bucket's codec work on the device
path is capturable in a CUDA graph, and a replay writes what the eager calls write.

Captured: the no-sync path of one bucket's codec calls, as the exchange makes them (its scratch buffers
from the bucket's workspace, :mod:`dqsgd.kernels.workspace`; checks deferred into a device flag): the
batched uplink encode of the S shards (norm, headers and bodies with the crc's level 0, the crc's levels
above), the decode-and-average of the W payloads of one shard, and the one-payload pair (encode, decode
with the expected header) the downlink uses. The replay's payload bytes and sums must equal the eager
calls' bit for bit, for the captured input and for new values copied into it (a graph replays its
kernels on whatever its input buffers hold).

What a replay does not change: the kernel arguments fixed at capture, among them the step's HashRNG key
(``triton_batch.split_keys``' base, the one-payload key): a graph captured at step s re-encodes with
step s's uniforms, so the test compares with eager calls at the captured step. Replaying one graph at
every step needs the step in a device tensor (docs/gpu-codec.md, "CUDA graphs").

The preconditions capture needs are tested on the CPU through Triton's interpreter: no host read and no
tensor made from host data after warm-up (test_kernels_triton_sync), the same scratch buffers at every
step and no other allocation than the call's outputs (test_kernels_triton_buffers), and the launches of
two steps differing only in the arguments named above (test_kernels_triton_graph_ready)."""

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs a CUDA GPU with compiled Triton (TRITON_INTERPRET unset): torch.cuda.graph captures "
                "CUDA streams only", allow_module_level=True)
pytest.importorskip("triton", reason="the triton package (the 'gpu' extra) is not installed")

from dqsgd.kernels import HashRNG, device_common, workspace  # noqa: E402
from dqsgd.kernels.batch import decode_batch, encode_batch  # noqa: E402
from dqsgd.kernels.device import decode_accumulate_device, encode_uniform_device, expected_header  # noqa: E402
from dqsgd.kernels.triton_batch import accumulate_batch_triton, encode_batch_triton  # noqa: E402
from dqsgd.quantizers import Layout, Norm  # noqa: E402

SHARDS, BITS, LAYOUT = 4, 4, Layout(bucket=4096)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


class Bucket:
    """One bucket's codec calls (device path, deferred checks), writing into buffers that stay."""

    def __init__(self, n: int) -> None:
        per = -(-n // SHARDS)
        self.spec = tuple((min(per, n - j * per), LAYOUT) for j in range(SHARDS))
        self.enc = encode_batch(self.spec, BITS, Norm.MAX, 1)
        m0 = self.spec[0][0]
        # the W payloads of shard 0 a shard server averages: here this rank's shard-0 payload W times
        self.dec = decode_batch((self.spec[0],) * SHARDS, BITS, Norm.MAX, (self.enc.offsets[0],) * SHARDS,
                                (0,) * SHARDS)
        self.keys = [HashRNG(3, 17, j).key for j in range(SHARDS)]
        self.head = expected_header((m0,), 8, layout=LAYOUT)
        self.x = torch.randn(n, device="cuda")
        self.avg = torch.zeros(m0, device="cuda")
        self.down = torch.zeros(m0, device="cuda")
        self.bad = torch.zeros((), dtype=torch.bool, device="cuda")
        self.ws: dict = {}

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        with workspace.use(self.ws):
            sent = encode_batch_triton(self.enc, self.x, self.keys)
            self.avg.zero_()
            accumulate_batch_triton(self.dec, sent, self.avg, 1.0 / SHARDS, self.bad)
            p = encode_uniform_device(self.avg, 8, HashRNG(3, 17, 99), layout=LAYOUT, check="defer")
            self.down.zero_()
            decode_accumulate_device(p, self.down, header=self.head, check="defer", bad=self.bad)
        return sent, p


def test_one_bucket_codec_replays_in_a_cuda_graph_as_eager() -> None:
    device_common.set_triton(True)
    try:
        b = Bucket(1_000_003)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compile, plans, tables, the workspace's buffers
            for _ in range(2):
                b()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sent_g, p_g = b()
        for seed in (None, 1, 2):
            if seed is not None:  # new values in the captured input
                b.x.copy_(torch.randn(b.x.shape, generator=torch.Generator().manual_seed(seed)).cuda())
            graph.replay()
            torch.cuda.synchronize()
            got = (sent_g.clone(), p_g.clone(), b.avg.clone(), b.down.clone())
            sent_e, p_e = b()  # eager, same workspace, same inputs
            torch.cuda.synchronize()
            assert torch.equal(got[0], sent_e) and torch.equal(got[1], p_e), seed
            assert bitwise(got[2], b.avg) and bitwise(got[3], b.down), seed
            assert not bool(b.bad), seed
        assert torch.isfinite(b.down).all() and b.down.abs().sum() > 0
    finally:
        device_common.set_triton(None)
