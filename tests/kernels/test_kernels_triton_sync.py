"""One bucket's exchange on the device path (the Triton batch, deferred checks) makes no host round trip
after its warm-up: nothing is read back from a tensor (``item``, ``tolist``, ``numpy``, ``cpu``, ``bool``,
``int``, ``float``) and no tensor is made from host data (``torch.tensor``, ``from_numpy``, …: on a GPU each
is a copy that waits for the device), outside the Triton launches themselves. Run on the CPU through
Triton's interpreter (see test_kernels_triton), where those calls are made to raise; the update is the
numba path's bit for bit."""

import contextlib
import os

import pytest
import torch

if os.environ.get("DQSGD_TRITON_TEST_DEVICE", "cpu") != "cpu":
    pytest.skip("run on the CPU through Triton's interpreter", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
pytest.importorskip("triton", reason="the triton package (the 'gpu' extra) is not installed")

from dqsgd.kernels import HashRNG, device_common  # noqa: E402
from dqsgd.kernels.triton_batch import split_keys, unmix64  # noqa: E402
from dqsgd.kernels.hashrng import mix64  # noqa: E402
from dqsgd.method.config import method_config  # noqa: E402
from dqsgd.topology import payloads  # noqa: E402
from dqsgd.topology.bucket import BucketProtocol  # noqa: E402
from dqsgd.topology.exchange import in_process  # noqa: E402

READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__")
MADE = ("tensor", "as_tensor", "from_numpy", "frombuffer")


@contextlib.contextmanager
def no_host_round_trip():
    """Make every host read and every tensor made from host data raise, except inside a Triton launch
    (the interpreter's own work, a GPU's kernel)."""
    from triton.runtime.jit import KernelInterface

    inside = [0]

    def guard(name, original):  # noqa: ANN001, ANN202
        def call(*a, **k):  # noqa: ANN002, ANN003, ANN202
            if not inside[0]:
                raise AssertionError(f"{name} on the device hot path")
            return original(*a, **k)
        return call

    launch_of = KernelInterface.__getitem__

    def launching(self, grid):  # noqa: ANN001, ANN202
        launch = launch_of(self, grid)

        def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            inside[0] += 1
            try:
                return launch(*a, **k)
            finally:
                inside[0] -= 1
        return run

    with pytest.MonkeyPatch.context() as mp:
        for n in READS:
            mp.setattr(torch.Tensor, n, guard(f"Tensor.{n}", getattr(torch.Tensor, n)))
        for n in MADE:
            mp.setattr(torch, n, guard(f"torch.{n}", getattr(torch, n)))
        mp.setattr(KernelInterface, "__getitem__", launching)
        yield


@contextlib.contextmanager
def device_path():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was set up for a GPU (TRITON_INTERPRET unset)")
    device_common.set_triton(True)
    payloads.route_cpu_through_device_codec(True)
    try:
        yield
    finally:
        payloads.route_cpu_through_device_codec(False)
        device_common.set_triton(None)


def test_the_guard_catches_a_host_read() -> None:
    with no_host_round_trip():
        with pytest.raises(AssertionError, match="Tensor.item on the device hot path"):
            torch.ones(1).sum().item()
        with pytest.raises(AssertionError, match="torch.tensor on the device hot path"):
            torch.tensor([1, 2])
    assert torch.ones(1).item() == 1.0  # undone after


def test_keys_split_into_a_base_and_a_rest_that_stays() -> None:
    """key_p = mix64(base ⊕ rest_p), and one rank's shard keys (one seed) keep their rest across steps:
    the table is copied to the device once, the base is a kernel argument."""
    for z in (0, 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF):
        assert unmix64(mix64(z)) == z and mix64(unmix64(z)) == z
    shards = [[HashRNG(11, step, 2 * 4 + j).key for j in range(4)] for step in (0, 1, 977)]
    rests = set()
    for keys in shards:
        base, rest = split_keys(keys)
        assert [mix64(base ^ r) for r in rest] == keys
        rests.add(rest)
    assert len(rests) == 1


@pytest.mark.slow  # the interpreter: a few seconds
@pytest.mark.parametrize("method", ["qsgd-4bit", "qsgd-2bit"])
def test_one_bucket_exchange_makes_no_host_round_trip(method: str) -> None:
    n, world = 3001, 3
    cfg = method_config(method)
    proto = BucketProtocol(cfg, n, [n], topology="sharded", workers=world, seed=0, total_steps=10, downlink_bits=8)
    flats = [torch.randn(n, generator=torch.Generator().manual_seed(w)) for w in range(world)]
    want = in_process(proto, flats, cfg.bits, 5)  # the numba kernels
    with device_path():
        in_process(proto, flats, cfg.bits, 0)  # warm-up: plans, tables and key tables on the device
        with no_host_round_trip():
            got = in_process(proto, flats, cfg.bits, 5)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
