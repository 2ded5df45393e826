"""DQSGD's width changes compile nothing after the bucket's first step: the exchange warms every width
of the policy's range (:mod:`dqsgd.topology.warm`), so every kernel specialisation a later step launches
was launched before. Run on the CPU through Triton's interpreter, with each launch's specialisation
key computed as Triton computes it on an H100/H200 (its CUDA backend's binder: constexpr arguments, integer
arguments equal to 1 or divisible by 16, pointer alignment), without compiling anything."""

import contextlib
import os

import pytest
import torch

if os.environ.get("DQSGD_TRITON_TEST_DEVICE", "cpu") != "cpu":
    pytest.skip("run on the CPU through Triton's interpreter", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
pytest.importorskip("triton", reason="the triton package (the 'gpu' extra) is not installed")

from dqsgd.kernels import device_common  # noqa: E402
from dqsgd.method.config import method_config  # noqa: E402
from dqsgd.topology import payloads  # noqa: E402
from dqsgd.topology.bucket import BucketProtocol  # noqa: E402
from dqsgd.topology.exchange import in_process  # noqa: E402


@contextlib.contextmanager
def specialisations(seen: list):
    """Append (kernel, Triton's cache key on sm_90) of every launch to ``seen``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, KernelInterface, compute_cache_key, create_function_from_signature

    backend, binders = make_backend(GPUTarget("cuda", 90, 32)), {}
    launch_of = KernelInterface.__getitem__

    def launching(self, grid):  # noqa: ANN001, ANN202
        launch = launch_of(self, grid)

        def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            if self.fn not in binders:
                jf = JITFunction(self.fn, **self.kwargs)
                binders[self.fn] = create_function_from_signature(jf.signature, jf.params, backend)
            _, spec, options = binders[self.fn](*a, **k)
            seen.append((self.fn.__name__, compute_cache_key({}, spec, options)))
            return launch(*a, **k)
        return run

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KernelInterface, "__getitem__", launching)
        yield


@pytest.mark.slow  # the interpreter: widths 2..5 of a small bucket, a few seconds each
def test_width_changes_launch_only_warmed_specialisations() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was set up for a GPU (TRITON_INTERPRET unset)")
    n, world = 2503, 2
    cfg = method_config("dqsgd", bits=3, min_bits=2, max_bits=5)
    proto = BucketProtocol(cfg, n, [n], topology="sharded", workers=world, seed=0, total_steps=10, downlink_bits=8)
    flats = [torch.randn(n, generator=torch.Generator().manual_seed(w)) for w in range(world)]
    first, later = [], []
    device_common.set_triton(True)
    payloads.route_cpu_through_device_codec(True)
    try:
        with specialisations(first):
            in_process(proto, flats, 3, 0)  # the bucket's first step: every width of [2, 5] warmed
        with specialisations(later):
            updates = {bits: in_process(proto, flats, bits, 1 + i) for i, bits in enumerate((5, 2, 4, 3))}
    finally:
        payloads.route_cpu_through_device_codec(False)
        device_common.set_triton(None)
    assert {k for k, _ in later} >= {"_encode_batch", "_decode_batch", "_crc_batch"}
    by_width = {}
    for name, key in later:
        by_width.setdefault(name, set()).add(key)
    assert len(by_width["_encode_batch"]) == 4  # one specialisation per width: what the warm-up is for
    assert set(later) <= set(first), sorted(set(later) - set(first))
    assert all(torch.isfinite(u).all() for u in updates.values())
