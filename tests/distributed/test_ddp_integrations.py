"""The DDP hook with Lightning, with torch.compile, and what ``import dqsgd.ddp`` loads."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _hook_ranks as hr
from dqsgd.cli.launch import spawn_local

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
COMPILE_ERRORS = ("InductorError", "CppCompileError", "BackendCompilerFailed", "CalledProcessError", "gcc", "g++")


@pytest.mark.timeout(500)
@pytest.mark.skipif(not (importlib.util.find_spec("lightning") or importlib.util.find_spec("pytorch_lightning")),
                    reason="Lightning is not installed (pip install 'dqsgd[lightning]')")
def test_lightning_example_trains_through_the_hook(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_ddp.py"), "--steps", "40", "--out", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["steps"] == 40 and s["bytes_sent"] > 0  # the hook ran on every step (not silently skipped on CPU)
    assert s["last_loss"] < 0.5 * s["first_loss"]
    assert s["total_ratio"] > 3  # against a ring all-reduce of the fp32 buckets


@pytest.mark.timeout(300)
def test_compiled_ddp_model_with_the_hook() -> None:
    results = spawn_local(hr.compiled, 2, ("inductor",), timeout=120, deadline=250)
    if not all(r.ok for r in results):
        text = " ".join(r.describe() for r in results)
        if any(e in text for e in COMPILE_ERRORS):
            pytest.skip(f"torch.compile cannot build kernels here: {text[:300]}")
        raise AssertionError(text)
    a, b = (r.value for r in results)
    if a["compiled_s"] > 60:
        pytest.skip(f"torch.compile took {a['compiled_s']:.0f} s here (> 60 s)")
    for s in range(3):
        assert torch.equal(a["compiled"][s], b["compiled"][s])  # every rank decodes the same bytes
        step = 2 * float(a["eager"][s].abs().max()) / 7  # one 4-bit quantization step of the average
        torch.testing.assert_close(a["compiled"][s], a["eager"][s], rtol=0, atol=step)
    st = a["compiled_stats"]
    assert st.steps == 3 and st.mean_bits == 4 and st.bytes_sent == a["eager_stats"].bytes_sent


def test_import_loads_only_what_the_hook_needs() -> None:
    code = ("import sys, json, torch, torch.distributed; before = set(sys.modules); import dqsgd.ddp; "
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    new = json.loads(r.stdout)
    heavy = [m for m in new if m.split(".")[0] in ("numba", "tqdm", "zstandard", "matplotlib", "scipy")
             or m in ("dqsgd.kernels", "dqsgd.codecs", "dqsgd.method.pipeline", "dqsgd.transport")]
    assert not heavy, heavy
