"""The Triton kernels of the FIXED uniform codec write the numba kernels' payload byte for byte and
decode it bit for bit, run on the CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` must be in the environment when the kernels are decorated (Triton reads it
in ``triton.jit``) and when they are first launched, so it is set here, before the kernel modules
are imported, and left set for the process (it changes nothing for code that does not use Triton).
The interpreter evaluates with numpy (no FMA contraction).

On a GPU the same module runs the compiled kernels on CUDA tensors: ``DQSGD_TRITON_TEST_DEVICE=cuda``
(``benchmarks/gpu_check.sh`` sets it) leaves ``TRITON_INTERPRET`` unset and puts every input on the
GPU; the references stay the numba kernels on the CPU.
"""

import os
import warnings
import zlib

import pytest
import torch

DEVICE = torch.device(os.environ.get("DQSGD_TRITON_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif not torch.cuda.is_available():
    pytest.skip(f"DQSGD_TRITON_TEST_DEVICE={DEVICE}, but CUDA is not available", allow_module_level=True)
pytest.importorskip("triton", reason="the triton package (the 'gpu' extra) is not installed")

from dqsgd.codecs import Coding, PayloadError  # noqa: E402
from dqsgd.codecs.wire import read_header  # noqa: E402
from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast  # noqa: E402
from dqsgd.kernels import device_common  # noqa: E402
from dqsgd.kernels.device import decode_accumulate_device, encode_uniform_device, expected_header  # noqa: E402
from dqsgd.kernels.triton_crc import crc32_triton  # noqa: E402
from dqsgd.quantizers import Layout, NonFiniteGradientError, Norm  # noqa: E402

RNG = HashRNG(7, 3, 5)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def triton_on_cpu():
    device_common.set_triton(True)
    yield
    device_common.set_triton(None)


def host(p: torch.Tensor) -> bytes:
    return bytes(p.cpu().numpy())


def on(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the device under test (the CPU through the interpreter, or a GPU)."""
    return x.to(DEVICE)


def layout_for(case: int, n: int) -> Layout:
    return (Layout(), Layout(bucket=97), Layout(sizes=(n // 3, 0, n - n // 3)))[case % 3]


@pytest.mark.slow
@pytest.mark.parametrize("bits", range(1, 17))
def test_triton_payload_and_sum_equal_numba(bits: int) -> None:
    """Widths 1..16, both norms, three dtypes, sizes that are not multiples of the 1024-coordinate
    block nor of the 8-value group: the same bytes (on a GPU, the l2 norm's scales to 1e-5: its
    reduction order is the device's); decoding them gives the same floats."""
    n = 1000 + 37 * bits
    case = 0
    for norm in (Norm.MAX, Norm.L2):
        for dtype in DTYPES:
            x = (torch.randn(n, generator=torch.Generator().manual_seed(bits * 10 + case)) * 3).to(dtype)
            layout = layout_for(case + bits, n)
            case += 1
            p = encode_uniform_device(on(x), bits, RNG, norm=norm, layout=layout)
            ref = encode_uniform_fast(x, bits, RNG, norm=norm, layout=layout, coding=Coding.FIXED)
            if norm == Norm.L2 and DEVICE.type != "cpu":
                # a float reduction in another order: the scales agree to a few ulps, not bitwise
                s_dev, s_host = read_header(host(p)).scales, read_header(ref).scales
                assert len(host(p)) == len(ref) and abs(s_dev - s_host).max() <= 1e-5 * s_host.max(), layout
            else:
                assert host(p) == ref, (norm, dtype, layout)
        base = torch.randn(n)
        want, got = base.clone(), on(base)
        decode_accumulate(host(p), want, 0.625)
        decode_accumulate_device(p, got, 0.625)
        assert torch.equal(got.cpu(), want)


def test_triton_empty_zero_and_one_element() -> None:
    for n in (0, 1, 9):
        for x in (torch.zeros(n), torch.randn(n)):
            for bits in (1, 13):
                p = encode_uniform_device(on(x), bits, RNG, layout=Layout(bucket=4))
                assert host(p) == encode_uniform_fast(x, bits, RNG, layout=Layout(bucket=4))
                out = on(torch.zeros(n))
                decode_accumulate_device(p, out)
                want = torch.zeros(n)
                decode_accumulate(host(p), want)
                assert torch.equal(out.cpu(), want)


def test_triton_norm_blocks_inside_one_segment() -> None:
    """Norm blocks of 4096 coordinates that lie inside one segment (one atomic) beside ones that
    straddle two (one atomic per coordinate), with buckets and with explicit sizes."""
    n = 9001
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    x[5000] = 40.0  # the largest value, inside the second segment
    for layout in (Layout(bucket=4096), Layout(sizes=(4096, 0, 700, n - 4796))):
        p = encode_uniform_device(on(x), 4, RNG, layout=layout)
        assert host(p) == encode_uniform_fast(x, 4, RNG, layout=layout)


@pytest.mark.parametrize("n", [0, 1, 3, 255, 256, 257, 2047, 2048, 2049, 4099, 70_001])
def test_triton_crc_is_zlibs(n: int) -> None:
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    dst = on(torch.zeros(4, dtype=torch.uint8))
    crc = crc32_triton(on(data), dst)
    want = zlib.crc32(bytes(data.numpy()))
    assert int(crc) & 0xFFFFFFFF == want and host(dst) == want.to_bytes(4, "little")


def test_triton_decode_refuses_corruption_and_leaves_out_untouched() -> None:
    n, bits = 1500, 3
    x = on(torch.randn(n))
    p = encode_uniform_device(x, bits, RNG, layout=Layout(bucket=100))
    hdr = expected_header((n,), bits, layout=Layout(bucket=100))
    for at in (len(p) - 2, len(p) - 20, 30):  # crc, body, header
        bad_p = p.clone()
        bad_p[at] ^= 0x10
        out = on(torch.randn(n))
        before = out.clone()
        with pytest.raises(PayloadError):
            decode_accumulate_device(bad_p, out)
        assert torch.equal(out, before)
        flag = on(torch.zeros((), dtype=torch.bool))
        decode_accumulate_device(bad_p, on(torch.zeros(n)), header=hdr, check="defer", bad=flag)
        assert bool(flag)
    flag = on(torch.zeros((), dtype=torch.bool))
    decode_accumulate_device(p, on(torch.zeros(n)), header=hdr, check="defer", bad=flag)
    assert not bool(flag)


def test_triton_code_out_of_range_and_padding_refused() -> None:
    n, bits = 13, 4  # 52 bits: 4 padding bits in the last byte
    p = encode_uniform_device(on(torch.randn(n)), bits, RNG)
    h = expected_header((n,), bits)
    for corrupt in ("code", "pad"):
        q = bytearray(host(p))
        if corrupt == "code":
            q[h.body_start] &= 0xF0  # value 0 = code −8, outside [−7, 7]
        else:
            q[h.body_start + h.body_len - 1] |= 0x80
        q[-4:] = zlib.crc32(bytes(q[:-4])).to_bytes(4, "little")
        with pytest.raises(PayloadError, match="codes span|padding"):
            decode_accumulate_device(on(torch.tensor(list(q), dtype=torch.uint8)), on(torch.zeros(n)))


@pytest.mark.parametrize("corrupt", ["header", "scale", "crc", "pad", "code"])
def test_triton_expected_header_checks_in_the_kernels(corrupt: str) -> None:
    """Each check of the no-sync decode (made in the decode kernel and the crc's last level): ``sync``
    names it and leaves ``out`` untouched, ``defer`` sets the flag (and never clears it). 300 scales:
    the header spans two programs of the header check, and the bad scale sits in the second."""
    n, bits, layout = 2995, 4, Layout(bucket=10)  # 2995·4 bits: 4 padding bits
    p = encode_uniform_device(on(torch.randn(n)), bits, RNG, layout=layout)
    h = expected_header((n,), bits, layout=layout)
    q = bytearray(host(p))
    at = {"header": 2, "scale": h.body_start - 9, "crc": len(q) - 1, "pad": h.body_start + h.body_len - 1,
          "code": h.body_start + 5}[corrupt]
    q[at] = {"header": q[at] ^ 1, "scale": 0xFF, "crc": q[at] ^ 0x80, "pad": q[at] | 0x80, "code": 0}[corrupt]
    if corrupt == "scale":
        q[at - 1] |= 0x80  # exponent bits all set: a NaN
    if corrupt != "crc":
        q[-4:] = zlib.crc32(bytes(q[:-4])).to_bytes(4, "little")
    bad_p = on(torch.tensor(list(q), dtype=torch.uint8))
    out = on(torch.randn(n))
    before = out.clone()
    match = {"header": "header differs", "scale": "non-finite scale", "crc": "crc mismatch", "pad": "padding",
             "code": "codes span"}[corrupt]
    with pytest.raises(PayloadError, match=match):
        decode_accumulate_device(bad_p, out, header=h)
    assert torch.equal(out, before)
    for start in (False, True):
        flag = on(torch.tensor(start))
        decode_accumulate_device(bad_p, on(torch.zeros(n)), header=h, check="defer", bad=flag)
        assert bool(flag)
        flag = on(torch.tensor(start))
        decode_accumulate_device(p, on(torch.zeros(n)), header=h, check="defer", bad=flag)
        assert bool(flag) == start


def test_triton_decodes_sign_and_ternary_payloads_like_the_host() -> None:
    """FIXED sign (1 bit) and ternary (2 bits) payloads also take the Triton decode: the host's sums."""
    from dqsgd.codecs import encode
    from dqsgd.quantizers import quantize_sign, quantize_ternary

    n = 1301
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    for b in (encode(quantize_sign(x)), encode(quantize_ternary(x, torch.Generator().manual_seed(1))),
              encode(quantize_sign(x, scaled=True, layout=Layout(sizes=(300, n - 300))))):
        out, want = on(torch.ones(n)), torch.ones(n)
        decode_accumulate_device(on(torch.frombuffer(bytearray(b), dtype=torch.uint8)), out, 0.5)
        decode_accumulate(b, want, 0.5)
        assert torch.equal(out.cpu(), want)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # numpy casting the NaN codes
def test_triton_refuses_nonfinite_input() -> None:
    x = torch.randn(2000)
    x[1234] = float("nan")
    x = on(x)
    with pytest.raises(NonFiniteGradientError):
        encode_uniform_device(x, 4, RNG, layout=Layout(bucket=500))
    p = encode_uniform_device(x, 4, RNG, layout=Layout(bucket=500), check="defer")  # a NaN scale, refused later
    with pytest.raises(PayloadError, match="non-finite scale"):
        decode_accumulate_device(p, on(torch.zeros(2000)), header=expected_header((2000,), 4, layout=Layout(bucket=500)))


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy on the NaN and Inf lanes
def test_triton_refusals_and_deferred_nan_scales_match_the_torch_ops() -> None:
    """A norm so small that s/r overflows (here a subnormal one), Inf in the input, all zeros: the
    kernel-written header refuses (``sync``) and writes NaN scales (``defer``) as the torch ops do.

    The header is compared byte for byte; the body only where every scale is finite: the codes of a
    segment whose scale is NaN come from NaN·x cast to an integer, which differs between numpy (the
    interpreter, the CPU) and a GPU (seen on an H200), and every decoder refuses such a payload."""
    for x in (torch.full((50,), 1e-39), torch.tensor([1e-39] * 20 + [1.0] * 20 + [float("inf")] * 5 + [0.0] * 10),
              torch.zeros(30)):
        for layout in (Layout(), Layout(bucket=10)):
            got = []
            for tri, dev in ((False, torch.device("cpu")), (True, DEVICE)):
                device_common.set_triton(tri)
                try:
                    encode_uniform_device(x.to(dev), 4, RNG, layout=layout)
                    said = "ok"
                except (ValueError, NonFiniteGradientError) as e:
                    said = str(e)
                got.append((said, host(encode_uniform_device(x.to(dev), 4, RNG, layout=layout, check="defer"))))
            (said_cpu, cpu), (said_dev, dev_p) = got
            assert said_cpu == said_dev and len(cpu) == len(dev_p)
            start = expected_header(tuple(x.shape), 4, layout=layout).body_start
            assert cpu[:start] == dev_p[:start]
            if said_cpu == "ok":
                assert cpu == dev_p


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the dispatch on a machine without a GPU")
def test_dispatch_default_and_warning_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    device_common.set_triton(None)
    assert not device_common.use_triton(torch.device("cpu"))
    assert device_common.use_triton(torch.device("cuda"))
    monkeypatch.setattr(device_common, "triton_available", lambda: False)
    monkeypatch.setattr(device_common, "_WARNED_NO_TRITON", False)
    with pytest.warns(RuntimeWarning, match="Triton is not installed"):
        assert not device_common.use_triton(torch.device("cuda"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once only
        assert not device_common.use_triton(torch.device("cuda"))
    device_common.set_triton(True)
    with pytest.raises(RuntimeError, match="not installed"):
        device_common.use_triton(torch.device("cpu"))


def test_hook_codec_runs_the_triton_kernels() -> None:
    """The DDP hook's device path (``ddp_codec``) reaches the Triton kernels through the dispatch."""
    from dqsgd.topology import payloads as ddp_codec

    ddp_codec.route_cpu_through_device_codec(True)
    try:
        x, layout = torch.randn(1100), Layout(bucket=256)
        p = ddp_codec.encode_uniform_payload(on(x), 2, RNG, norm=Norm.MAX, layout=layout)
        assert p.device.type == DEVICE.type and host(p) == encode_uniform_fast(x, 2, RNG, layout=layout)
        out, want = on(torch.zeros(1100)), torch.zeros(1100)
        flag = on(torch.zeros((), dtype=torch.bool))
        ddp_codec.decode_accumulate_payload(p, out, max_numel=1100, expect=(2, Norm.MAX, layout), bad=flag)
        decode_accumulate(host(p), want)
        assert torch.equal(out.cpu(), want) and not bool(flag)
    finally:
        ddp_codec.route_cpu_through_device_codec(False)


@pytest.mark.slow
def test_library_works_without_triton(tmp_path) -> None:  # noqa: ANN001 - pytest's tmp_path
    """With the triton package absent: dqsgd imports, the device codec runs its torch ops, and a
    CUDA device is told once that Triton is missing (a fresh process where ``import triton`` fails)."""
    import subprocess
    import sys

    script = tmp_path / "no_triton.py"
    script.write_text(
        "import importlib.abc, importlib.machinery, sys, warnings\n"
        "class L(importlib.abc.Loader):\n"
        "    def create_module(self, spec): return None\n"
        "    def exec_module(self, m): raise ModuleNotFoundError('no triton')\n"
        "class F(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        return None if name.split('.')[0] != 'triton' else importlib.machinery.ModuleSpec(name, L())\n"
        "sys.meta_path.insert(0, F())\n"
        "import torch\n"
        "from dqsgd.kernels import HashRNG, encode_uniform_fast\n"
        "from dqsgd.kernels import device_common\n"
        "from dqsgd.kernels.device import encode_uniform_device\n"
        "device_common.triton_available = lambda: False  # find_spec sees this finder's spec\n"
        "x = torch.randn(1000)\n"
        "r = HashRNG(1, 2, 3)\n"
        "assert bytes(encode_uniform_device(x, 4, r).numpy()) == encode_uniform_fast(x, 4, r)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    assert not device_common.use_triton(torch.device('cuda'))\n"
        "    assert not device_common.use_triton(torch.device('cuda'))\n"
        "assert len(w) == 1 and 'Triton is not installed' in str(w[0].message), w\n"
        "assert not any(m.split('.')[0] == 'triton' and sys.modules[m] is not None for m in sys.modules)\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
