"""The compiled path (``torch.compile``, what CUDA runs) forced on CPU gives the same bytes and sums.

It runs in a subprocess with a time limit: inductor compiles C++ with the host compiler, which can
be slow or absent; then the test is skipped and says why (a wrong result still fails)."""

import subprocess
import sys
import textwrap

import pytest

LIMIT_S = 60

SCRIPT = textwrap.dedent("""
    import sys, torch
    from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast
    from dqsgd.kernels.device import decode_accumulate_device, encode_uniform_device, set_compile
    from dqsgd.quantizers import Layout
    set_compile(True)
    rng, layout = HashRNG(1, 2, 3), Layout(bucket=256)
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    for bits in (5,):
        try:
            p = encode_uniform_device(x, bits, rng, layout=layout)
            out = torch.randn(1001)
            want = out.clone()
            decode_accumulate_device(p, out)
        except Exception as e:  # the compiler, not the codec
            print("COMPILE FAILED", type(e).__name__, str(e)[:300])
            sys.exit(3)
        assert bytes(p.numpy()) == encode_uniform_fast(x, bits, rng, layout=layout), bits
        decode_accumulate(bytes(p.numpy()), want)
        assert torch.equal(out, want), bits
    print("OK")
""")


def test_compiled_path_on_cpu_matches_the_host_kernel() -> None:
    try:
        res = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT], capture_output=True, text=True,
                             timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"torch.compile of the device codec took over {LIMIT_S} s on this machine")
    if res.returncode == 3:
        pytest.skip(f"torch.compile failed here: {res.stdout.strip()[-300:]}")
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout[-2000:] + res.stderr[-2000:]
