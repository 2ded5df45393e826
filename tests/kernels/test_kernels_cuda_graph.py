"""On a GPU (``benchmarks/gpu_check.sh`` runs it; skipped elsewhere): one bucket's codec work on the device
path is capturable in a CUDA graph, captured once, and a replay at every later step writes what that
step's eager calls write.

Captured: the no-sync path of one bucket's codec calls, as the exchange makes them (its scratch buffers
from the bucket's workspace, :mod:`dqsgd.kernels.workspace`; checks deferred into a device flag): the
batched uplink encode of the S shards (norm, headers and bodies with the crc's level 0, the crc's levels
above), the decode-and-average of the W payloads of one shard, and the one-payload pair (encode, decode
with the expected header) the downlink uses. The encodes read the step's HashRNG key from two 1-element
device tensors (``key=``; ``workspace.write_key`` writes a step's key into them, outside the graph), so
one graph serves every step: before each replay the step's keys (and new gradient values) are written
into the captured buffers, and the replay's payload bytes and sums must equal that step's eager calls'
bit for bit.

The preconditions capture needs are tested on the CPU through Triton's interpreter: no host read and no
tensor made from host data after warm-up (test_kernels_triton_sync), the same scratch buffers at every
step and no other allocation than the call's outputs (test_kernels_triton_buffers), the launches of
two steps differing only in the contents of the key tensors (test_kernels_triton_graph_ready), and the
same calls at several steps with the key tensors written in place giving each step's bytes
(test_kernels_triton_exchange_calls)."""

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
from dqsgd.kernels.triton_batch import accumulate_batch_triton, encode_batch_triton, split_keys  # noqa: E402
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
        self.head = expected_header((m0,), 8, layout=LAYOUT)
        self.x = torch.randn(n, device="cuda")
        self.avg = torch.zeros(m0, device="cuda")
        self.down = torch.zeros(m0, device="cuda")
        self.bad = torch.zeros((), dtype=torch.bool, device="cuda")
        self.up_key = torch.zeros(1, dtype=torch.int64, device="cuda")  # the keys the graph's encodes read
        self.down_key = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.ws: dict = {}

    @staticmethod
    def keys(step: int) -> list[int]:
        return [HashRNG(3, step, j).key for j in range(SHARDS)]

    def set_step(self, step: int) -> None:
        """The step's keys into the tensors the captured encodes read (outside the graph)."""
        workspace.write_key(self.up_key, split_keys(self.keys(step))[0])
        workspace.write_key(self.down_key, HashRNG(3, step, 99).key)

    def __call__(self, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager at ``step``; None: the graph's form (step 0's arguments, the keys read from the tensors)."""
        given = step is None
        s = 0 if given else step
        with workspace.use(self.ws):
            sent = encode_batch_triton(self.enc, self.x, self.keys(s), key=self.up_key if given else None)
            self.avg.zero_()
            accumulate_batch_triton(self.dec, sent, self.avg, 1.0 / SHARDS, self.bad)
            p = encode_uniform_device(self.avg, 8, HashRNG(3, s, 99), layout=LAYOUT, check="defer",
                                      key=self.down_key if given else None)
            self.down.zero_()
            decode_accumulate_device(p, self.down, header=self.head, check="defer", bad=self.bad)
        return sent, p


def test_one_bucket_codec_captured_once_replays_every_step_as_eager() -> None:
    device_common.set_triton(True)
    try:
        b = Bucket(1_000_003)
        b.set_step(17)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compile, plans, tables, the workspace's buffers
            for _ in range(2):
                b()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sent_g, p_g = b()
        seen = set()
        for step, seed in ((17, None), (18, None), (19, 1), (40, 2)):
            if seed is not None:  # new values in the captured input
                b.x.copy_(torch.randn(b.x.shape, generator=torch.Generator().manual_seed(seed)).cuda())
            b.set_step(step)
            graph.replay()
            torch.cuda.synchronize()
            got = (sent_g.clone(), p_g.clone(), b.avg.clone(), b.down.clone())
            sent_e, p_e = b(step)  # eager at that step, same workspace, same inputs
            torch.cuda.synchronize()
            assert torch.equal(got[0], sent_e) and torch.equal(got[1], p_e), step
            assert bitwise(got[2], b.avg) and bitwise(got[3], b.down), step
            assert not bool(b.bad), step
            seen.add(bytes(got[0][:4096].cpu().numpy()))
        assert len(seen) == 4  # every step its own uniforms
        assert torch.isfinite(b.down).all() and b.down.abs().sum() > 0
    finally:
        device_common.set_triton(None)
