"""On a GPU (``benchmarks/gpu_check.sh`` runs it; skipped elsewhere): one bucket's exchange on CUDA makes no
synchronizing CUDA call after its first step (``torch.cuda.set_sync_debug_mode("error")``), and DQSGD's width
changes compile no kernel (:func:`dqsgd.kernels.device_common.compiled_variants`). The same claims are
tested on the CPU through Triton's interpreter by test_kernels_triton_sync and test_kernels_triton_widths."""

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs a CUDA GPU with compiled Triton (TRITON_INTERPRET unset)", allow_module_level=True)
pytest.importorskip("triton", reason="the triton package (the 'gpu' extra) is not installed")

from dqsgd.kernels.device_common import compiled_variants  # noqa: E402
from dqsgd.method.config import method_config  # noqa: E402
from dqsgd.topology.bucket import BucketProtocol  # noqa: E402
from dqsgd.topology.exchange import in_process  # noqa: E402


@pytest.mark.parametrize("method, widths", [("qsgd-4bit", (4, 4)), ("dqsgd", (3, 16, 2, 7))])
def test_exchange_on_cuda_syncs_nothing_and_compiles_nothing_after_its_first_step(method: str, widths) -> None:
    n, world = 1_000_003, 4
    cfg = method_config(method)
    proto = BucketProtocol(cfg, n, [n], topology="sharded", workers=world, seed=0, total_steps=10, downlink_bits=8)
    flats = [torch.randn(n, generator=torch.Generator().manual_seed(w)).cuda() for w in range(world)]
    first = in_process(proto, flats, widths[0], 0)  # tables, key tables, the widths' kernels compiled
    torch.cuda.synchronize()
    before = compiled_variants()
    torch.cuda.set_sync_debug_mode("error")
    try:
        updates = [in_process(proto, flats, bits, 1 + i) for i, bits in enumerate(widths)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert compiled_variants()["triton"] == before["triton"]
    assert all(bool(torch.isfinite(u).all()) for u in [first, *updates])
