"""What a CUDA graph of one bucket's exchange would freeze: a graph replays its kernels with the
arguments they had at capture. Recorded on the CPU through Triton's interpreter (see
test_kernels_triton): the Triton launches of one bucket's exchange on the device path at two steps of
the same width, after warm-up, are the same kernels with the same grids and the same scalar arguments;
the step's HashRNG key (the batched encode's ``base``, the one-payload encode's key) is read by the
kernels from a device tensor (``workspace.step_key``: a buffer of the bucket's workspace, the same
tensor at every step, test_kernels_triton_buffers) whose contents are the step's key. So nothing but
the contents of that tensor changes between steps: a graph captured once replays every step once the
caller writes the step's key into it (on a GPU: test_kernels_cuda_graph). The other preconditions of capture (no host read, no tensor from host data,
the same scratch buffers at every step) are test_kernels_triton_sync's and test_kernels_triton_buffers'."""

import inspect
import os

import pytest
import torch

if os.environ.get("DQSGD_TRITON_TEST_DEVICE", "cpu") != "cpu":
    pytest.skip("run on the CPU through Triton's interpreter", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
pytest.importorskip("triton", reason="the triton package (the 'gpu' extra) is not installed")

from dqsgd.kernels import device_common  # noqa: E402
from dqsgd.kernels.triton_batch import split_keys  # noqa: E402
from dqsgd.method.config import method_config  # noqa: E402
from dqsgd.topology import payloads  # noqa: E402
from dqsgd.topology.bucket import BucketProtocol  # noqa: E402
from dqsgd.topology.exchange import in_process  # noqa: E402

STEP_KEYS = {"_encode_batch": "base_ptr", "_encode_kernel": "key_ptr"}  # kernel: the tensor it reads the key from


def launches_of(call) -> list[tuple[str, tuple, dict, tuple | None]]:  # noqa: ANN001 - a thunk
    """(kernel, grid, scalar arguments by name, (address, value) of the key tensor it reads, if any) of
    every Triton launch ``call()`` makes."""
    from triton.runtime.jit import KernelInterface

    seen, launch_of = [], KernelInterface.__getitem__

    def recording(self, grid):  # noqa: ANN001, ANN202 - Triton's own signature
        launch, fn = launch_of(self, grid), getattr(self, "fn", self)

        def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            bound = inspect.signature(fn).bind_partial(*a, **{n: v for n, v in k.items()
                                                               if n in inspect.signature(fn).parameters})
            scalars = {n: v for n, v in bound.arguments.items() if not isinstance(v, torch.Tensor)}
            key = bound.arguments.get(STEP_KEYS.get(fn.__name__, ""))
            seen.append((fn.__name__, tuple(grid), scalars,
                         None if key is None else (key.data_ptr(), int(key.reshape(-1)[0]) & (1 << 64) - 1)))
            return launch(*a, **k)
        return run

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KernelInterface, "__getitem__", recording)
        call()
    return seen


@pytest.mark.slow  # the interpreter: a few seconds
def test_two_steps_launch_the_same_work_but_for_the_key_tensors_contents() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was set up for a GPU (TRITON_INTERPRET unset)")
    n, world, cfg = 5001, 3, method_config("qsgd-4bit")
    proto = BucketProtocol(cfg, n, [n], topology="sharded", workers=world, seed=0, total_steps=10, downlink_bits=8)
    flats = [torch.randn(n, generator=torch.Generator().manual_seed(w)) for w in range(world)]
    device_common.set_triton(True)
    payloads.route_cpu_through_device_codec(True)
    try:
        in_process(proto, flats, cfg.bits, 0)  # warm-up
        one, two = (launches_of(lambda s=s: in_process(proto, flats, cfg.bits, s)) for s in (1, 2))
    finally:
        payloads.route_cpu_through_device_codec(False)
        device_common.set_triton(None)
    assert one and [(k, g) for k, g, _, _ in one] == [(k, g) for k, g, _, _ in two]
    differ = {(k, name) for (k, _, a, _), (_, _, b, _) in zip(one, two) for name in a if a[name] != b[name]}
    assert not differ, differ  # no scalar argument changes: the key is not one any more
    # both decodes (the W payloads of a shard, the S downlink payloads) write their sums without reading `out`
    assert [a["FRESH"] for k, _, a, _ in one if k == "_decode_batch"] == [True] * 2 * world
    for step, launches in ((1, one), (2, two)):
        keys = [(k, key[1]) for k, _, _, key in launches if key is not None]
        up = {split_keys([proto.uplink_rng(step, w, j).key for j in range(world)])[0] for w in range(world)}
        down = {proto.downlink_rng(step, j).key for j in range(world)}
        assert {k for k, _ in keys} == set(STEP_KEYS)
        assert {v for k, v in keys if k == "_encode_batch"} == up
        assert {v for k, v in keys if k != "_encode_batch"} <= down
    # the key tensors are scratch buffers of the bucket's workspace: the same tensors at every step of one rank
    # (test_kernels_triton_buffers; in_process starts each step with a fresh workspace)
