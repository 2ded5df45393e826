"""What one no-sync codec pair issues on the Triton path (the GPU's code path), counted on the CPU
through Triton's interpreter by ``benchmarks/gpu_call_cost.py --count``: an upper bound per kind, so
a change that adds launches or torch ops to the hook's hot path fails here.

The pair is ``encode_uniform_device(x, 4, rng, check="defer")`` and
``decode_accumulate_device(p, out, header=expected_header(...), check="defer", bad=flag)`` at
n = 1000; before the kernels took over the header, the scales' checks and the decode's flags it
issued 7 Triton launches and 53 kernel-launching aten ops (212 aten ops in all).
"""

import os
from pathlib import Path

import pytest

if os.environ.get("DQSGD_TRITON_TEST_DEVICE", "cpu") != "cpu":  # a GPU run of the Triton tests: leave Triton compiled
    pytest.skip("the counts run on the CPU through Triton's interpreter", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported (see test_kernels_triton)
pytest.importorskip("triton", reason="the triton package (the 'gpu' extra) is not installed")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the interpreter and the profiler: a few seconds
def test_one_pair_issues_few_launches_and_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was set up for a GPU (TRITON_INTERPRET unset): the counts run through the interpreter")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_call_cost import count_pair

    c = count_pair(1000)
    # norm, header + body, the crc (one level up to 2 KiB), decode + checks, the crc check + verdict
    assert c["by_kernel"] == {"_absmax_kernel": 1, "_crc_level": 2, "_decode_kernel": 1, "_encode_kernel": 1}
    # the norm's zero fill, 1/r, r/levels, and the fill of the step's key into the tensor the encode reads it
    # from (workspace.step_key): all that runs outside the kernels
    assert c["aten_kernels"] <= 4, c["by_op"]
    assert c["aten_ops"] <= 34, c
