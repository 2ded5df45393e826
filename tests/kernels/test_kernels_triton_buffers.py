"""One bucket's exchange on the device path (the Triton batch, deferred checks) makes after its warm-up
only the buffers that leave the call: its scratch buffers (the norms' bit patterns, ``1/r``, ``r/levels``,
the decode's flags, the crc's partial values, the sum the update is copied from) are made at the
bucket's first step, kept in each rank's workspace for the bucket (``Memory.workspace``,
:mod:`dqsgd.kernels.workspace`) and handed back at every later step. Counted on the CPU through
Triton's interpreter (see test_kernels_triton): every tensor factory call (``empty``, ``zeros``,
``full``, …) outside the Triton launches, per rank and step, at W = 2, 4 and 8; the update is the
numba path's bit for bit at every step, and an update handed out is never written by a later step."""

import os
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("DQSGD_TRITON_TEST_DEVICE", "cpu") != "cpu":
    pytest.skip("run on the CPU through Triton's interpreter", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
pytest.importorskip("triton", reason="the triton package (the 'gpu' extra) is not installed")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from dqsgd.kernels import device_common  # noqa: E402
from dqsgd.method.config import method_config  # noqa: E402
from dqsgd.topology import payloads  # noqa: E402
from dqsgd.topology.bucket import BucketProtocol  # noqa: E402
from dqsgd.topology.exchange import Exchange, in_process  # noqa: E402
from dqsgd.topology.group import local_groups  # noqa: E402
from dqsgd.topology.state import BucketState, Memory  # noqa: E402

FACTORIES = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
             "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "scalar_tensor", "arange",
             "lift_fresh_copy", "rand", "randn", "randint"}
# per rank and step, the buffers that leave the call: the uplink's payloads (the all-to-all reads their
# message after the call; Outcome.sent holds views of them), the averaged shard (FSDP's outcome; the
# error-fed downlink stages a residual from it), and the downlink's payload and the zeros that pad it into
# the message the all-gather reads after the call
PER_RANK = 4


class Factories(TorchDispatchMode):
    """Count the tensor factory calls made outside a Triton launch (the interpreter's own work)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if not self.inside and name in FACTORIES:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch):
    from triton.runtime.jit import KernelInterface

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was set up for a GPU (TRITON_INTERPRET unset)")
    mode, launch_of = Factories(), KernelInterface.__getitem__

    def launching(self, grid):  # noqa: ANN001, ANN202 - Triton's own signature
        launch = launch_of(self, grid)

        def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            mode.inside += 1
            try:
                return launch(*a, **k)
            finally:
                mode.inside -= 1
        return run

    monkeypatch.setattr(KernelInterface, "__getitem__", launching)
    return mode


def test_the_count_sees_a_factory_call(counting: Factories) -> None:
    with counting:
        torch.zeros(3)
        torch.ones(2).add_(1)
    assert counting.calls == Counter(zeros=1, ones=1)


@pytest.mark.slow  # the interpreter: about a minute
@pytest.mark.parametrize("world", [2, 4, 8])
def test_one_bucket_exchange_allocates_only_its_outputs_after_warm_up(world: int, counting: Factories) -> None:
    n, cfg = 1001, method_config("qsgd-4bit")
    proto = BucketProtocol(cfg, n, [n], topology="sharded", workers=world, seed=0, total_steps=10, downlink_bits=8)
    grads = [[torch.randn(n, generator=torch.Generator().manual_seed(100 * s + w)) for w in range(world)]
             for s in range(3)]
    want = [in_process(proto, flats, cfg.bits, s) for s, flats in enumerate(grads)]  # the numba kernels
    b = BucketState(numel=n, proto=proto, policy=SimpleNamespace(bits=cfg.bits, down_bits=None), step=0)
    groups, mems = local_groups(world), [Memory() for _ in range(world)]
    device_common.set_triton(True)
    payloads.route_cpu_through_device_codec(True)
    try:
        got, counts, kept = [], [], []
        for s, flats in enumerate(grads):
            counting.calls.clear()
            with counting:
                futures = Exchange(b).start({w: (g, groups[w], mems[w]) for w, g in enumerate(flats)})
                updates = [groups[0].wait(futures[w]).update for w in range(world)]
            got.append(updates)
            counts.append(sum(counting.calls.values()))
            kept.append({k: t.data_ptr() for k, t in mems[0].workspace.items()})
    finally:
        payloads.route_cpu_through_device_codec(False)
        device_common.set_triton(None)
    for s in range(3):
        for u in got[s]:
            assert torch.equal(u.view(torch.int32), want[s].view(torch.int32)), s
    assert counts[0] > counts[1]  # the first step makes the scratch buffers
    assert counts[1:] == [PER_RANK * world] * 2, (counts, counting.calls)
    assert kept[0] and kept[0] == kept[1] == kept[2]  # the same buffers, made once
    assert len({u.data_ptr() for us in got for u in us}) == 3 * world  # every update its own tensor
