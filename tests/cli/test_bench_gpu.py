"""``dqsgd bench gpu``'s CPU parts: arguments, the no-GPU exit, the report, and the loopback hook."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dqsgd.cli.bench.parser import parse_args


def test_arguments_and_defaults() -> None:
    a = parse_args(["bench", "gpu", "--out", "r"])
    assert (a.out, a.sizes, a.bits, a.worlds, a.models, a.device) == (
        "r", [1_000_000, 25_000_000, 100_000_000], [1, 2, 4, 8], [4, 8], ["resnet18", "transformer"], "auto")
    a = parse_args(["bench", "gpu", "--out", "r", "--sizes", "1e3,2e3", "--worlds", "2", "--models", "resnet18"])
    assert a.sizes == [1000, 2000] and a.worlds == [2] and a.models == ["resnet18"]
    assert parse_args(["bench", "gpu"]).out == "runs/bench/gpu"  # where the other benchmarks write
    with pytest.raises(SystemExit):
        parse_args(["bench", "gpu", "--out", "r", "--device", "cuda:1"])


def test_without_a_gpu_it_says_so_and_exits_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from dqsgd.cli.bench.gpu import bench_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_gpu(parse_args(["bench", "gpu", "--out", str(tmp_path / "r")])) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no CUDA device" in out[0] and "GPU not measured" in out[0]
    assert not (tmp_path / "r").exists()


def _fake(device: str) -> dict:
    env = {"device": device, "gpu": "Fake GPU 80GB" if device == "cuda" else None, "torch": "2.x", "cuda": "12.x",
           "triton": "3.x", "numba": "0.x", "python": "3.11", "command": "dqsgd bench gpu --out r", "utc": "now"}
    return {"environment": env,
            "correctness": [{"bits": 4, "norm": "max", "kernels": "triton", "claimed": "bytes", "bytes_equal": True,
                             "scale_rel": 0.0, "decode_bitwise": True, "corrupt_refused": True}],
            "codec": [{"path": "triton", "n": 25_000_000, "bits": 4, "enc": 0.61, "dec": 0.9, "both": 0.37,
                       "copy_ms": 0.1, "both_ms": 0.27}],
            "ddp": {"rows": [{"model": "resnet18", "world": 4, "hook": "qsgd-4bit", "ms": 12.5, "ratio": 1.1,
                              "min": 1.0, "max": 1.2, "bytes": 1000.0, "peak_mb_over_none": 30.0}],
                    "recompilations": {"triton": 0, "torch.compile": None}}}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_report_from_a_fake_result(device: str, tmp_path: Path) -> None:
    from dqsgd.cli.bench.gpu import write_report

    js, md = write_report(_fake(device), tmp_path / "out")
    assert json.loads(js.read_text()) == _fake(device)
    text = md.read_text()
    first = text.splitlines()[0]
    if device == "cuda":
        assert "Fake GPU 80GB" in first and "CPU" not in first
    else:
        assert "CPU TEST RUN" in first and "GPU not measured" in first
    assert "| triton | 25000000 | 4 | 0.61 | 0.9 | 0.37 |" in text
    assert "| resnet18 | 4 | qsgd-4bit | 12.5 | 1.1 | 1 | 1.2 | 1e+03 | 30 |" in text
    assert "Recompilations after warm-up: triton 0, torch.compile n/a (interpreter: nothing compiled)." in text


def _loop_steps(loop, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    from dqsgd.fsdp.hsdp import ShardBucket

    return [loop.run(ShardBucket(0, g.clone(), [g.numel()], last=True)).wait() for g in grads]


def test_the_loopback_is_rank_0_of_the_hooks_exchange() -> None:
    """W = 2, qsgd-4bit: the bucket after the hook's exchange where rank 1 sent rank 0 a replica of
    its payload for shard 0 and served shard 1 from rank 0's first gradient — the bucket protocol's
    own encode, reduce, encode_down and decode_down composed by hand, bitwise (two steps: the peer's
    message is encoded once)."""
    from dqsgd.cli.bench.loopback import LoopbackHook

    n = 5003
    loop = LoopbackHook("qsgd-4bit", 2, total_steps=10, seed=3)
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    got = _loop_steps(loop, grads)
    P = loop.buckets[0].proto
    (_, hi), (lo, _) = P.bounds
    served = P.encode_down(1, grads[0][lo:], 0)
    for step, (g, out) in enumerate(zip(grads, got)):
        mine = P.encode(0, g, 4, step, None)[0][0]
        want = P.decode_down([P.encode_down(0, P.reduce(0, [mine, mine], 4), step), served])
        assert torch.equal(out, want), step
        assert 0 < float((out[:hi] - g[:hi]).norm() / g[:hi].norm()) < 1  # quantized, and near the gradient
    with pytest.raises(ValueError, match="W >= 2"):
        LoopbackHook("qsgd-4bit", 1)


@pytest.mark.parametrize("method", ["qsgd-4bit", "dqsgd"])
def test_the_loopback_encodes_what_one_rank_encodes(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """W = 4: per step one uplink encode of the W shards and one downlink encode (its own shard), the
    other servers' messages encoded once per downlink width (dqsgd: "auto", the widths the policy
    picks); decoded into the bucket near the gradient."""
    from dqsgd.cli.bench.loopback import LoopbackHook
    from dqsgd.topology.bucket import BucketProtocol

    calls: list[int] = []
    encode_down = BucketProtocol.encode_down
    monkeypatch.setattr(BucketProtocol, "encode_down", lambda self, j, *a, **k: (calls.append(j), encode_down(
        self, j, *a, **k))[1])
    loop = LoopbackHook(method, 4, total_steps=10)
    g = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    widths = []
    for _ in range(5):
        widths.append(loop.buckets[0].proto.down_width(loop.buckets[0].policy) if loop.buckets else None)
        out = _loop_steps(loop, [g])[0]
        assert 0 < float((out - g).norm() / g.norm()) < 1
    widths = widths[1:] + [loop.buckets[0].proto.down_width(loop.buckets[0].policy)]
    assert calls.count(0) == 5 and len(calls) == 5 + 3 * len(set(widths)), (calls, widths)


@pytest.mark.slow
def test_simulation_rows_on_cpu() -> None:
    """Simulation steps per second on synthetic data: one row per method, SGD the reference."""
    from dqsgd.cli.bench.gpu import simulation

    rows = simulation(torch.device("cpu"), ["cnn"], steps=1, warmup=1, workers=2)
    assert [r["method"] for r in rows] == ["sgd", "qsgd-4bit", "dqsgd"]
    assert rows[0]["vs_sgd"] == 1.0 and all(r["steps_per_s"] > 0 for r in rows)


def test_a_failed_phase_is_reported_and_the_others_still_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys) -> None:
    """One phase raising loses nothing: the report is written after every phase, the failure is named in
    gpu.md and gpu.json, the later phases run, and the exit code is 1; a correctness row that is not all
    True also exits 1."""
    from dqsgd.cli.bench import gpu, gpu_step

    def boom(*a, **k):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(gpu, "correctness", boom)
    monkeypatch.setattr(gpu, "codec_speed", lambda *a, **k: _fake("cpu")["codec"])
    monkeypatch.setattr(gpu_step, "step_times", lambda *a, **k: _fake("cpu")["ddp"])
    monkeypatch.setattr(gpu_step, "host_times", lambda *a, **k: [])
    monkeypatch.setattr(gpu, "simulation", lambda *a, **k: [{"model": "cnn", "method": "sgd", "steps_per_s": 1.0,
                                                              "vs_sgd": 1.0}])
    args = parse_args(["bench", "gpu", "--out", str(tmp_path / "r"), "--device", "cpu"])
    assert gpu.bench_gpu(args) == 1
    res = json.loads((tmp_path / "r" / "gpu.json").read_text())
    assert res["errors"] == {"correctness": "RuntimeError: kernel exploded"}
    assert {"codec", "ddp", "simulation"} <= set(res) and set(res["seconds"]) == {"correctness", "codec", "ddp",
                                                                                  "host", "simulation"}
    assert "- correctness: `RuntimeError: kernel exploded`" in (tmp_path / "r" / "gpu.md").read_text()
    assert "FAILED correctness: RuntimeError: kernel exploded" in capsys.readouterr().out
    row = {"bits": 2, "norm": "max", "kernels": "triton", "claimed": "bytes", "bytes_equal": False,
           "scale_rel": 0.0, "decode_bitwise": True, "corrupt_refused": True}
    monkeypatch.setattr(gpu, "correctness", lambda *a, **k: [row])
    assert gpu.bench_gpu(args) == 1
    assert "correctness bits=2 norm=max: bytes_equal is False" in capsys.readouterr().out
    row.update(norm="l2", claimed="decode, scales", scale_rel=3e-8)  # l2: bytes reported, not claimed
    assert gpu.bench_gpu(args) == 0
    row.update(scale_rel=1e-3)
    assert gpu.bench_gpu(args) == 1
    assert "correctness bits=2 norm=l2: scales differ by 0.001 (relative) > 1e-05" in capsys.readouterr().out
    monkeypatch.setattr(gpu, "correctness", lambda *a, **k: _fake("cpu")["correctness"])
    assert gpu.bench_gpu(args) == 0


def test_correctness_phase_runs_on_the_cpu() -> None:
    """The correctness phase itself (the torch-ops codec on the CPU): every check holds."""
    from dqsgd.cli.bench.gpu import correctness

    rows = correctness(torch.device("cpu"), 10_001)
    assert len(rows) == 10 and {r["claimed"] for r in rows} == {"bytes", "decode, scales"}
    assert all(r["bytes_equal"] and r["decode_bitwise"] and r["corrupt_refused"] and r["scale_rel"] == 0
               for r in rows)


def test_bytes_each_hook_sends() -> None:
    """The bytes one rank sends per step: ring all-reduces of fp32 / fp16, PowerSGD's factors where
    PyTorch compresses (a 64×32 matrix at rank 1: 64 + 32 elements; its 64-element bias: uncompressed),
    and the sharded exchange's uplink messages to the other servers and its downlink message to the others."""
    from dqsgd.cli.bench.gpu_step import wire_bytes
    from dqsgd.kernels.codec import fixed_plan
    from dqsgd.quantizers import Layout, Norm
    from dqsgd.core.sharding import shard_bounds

    shapes, n, w = [(64, 32), (64,)], 64 * 32 + 64, 4
    assert wire_bytes(shapes, "none", w) == 2 * 3 / 4 * 4 * n
    assert wire_bytes(shapes, "fp16", w) == wire_bytes(shapes, "bf16", w) == 2 * 3 / 4 * 2 * n
    assert wire_bytes(shapes, "powersgd-1", w) == 2 * 3 / 4 * 4 * (64 + 32 + 64)
    assert wire_bytes(shapes, "powersgd-4", w) == 2 * 3 / 4 * 4 * (4 * (64 + 32) + 64)
    bounds = shard_bounds(n, w)
    up = sum(fixed_plan(hi - lo, 4, Norm.MAX, Layout()).size + 1 for lo, hi in bounds)
    down = max(fixed_plan(hi - lo, 8, Norm.MAX, Layout()).size for lo, hi in bounds) + 1
    assert wire_bytes(shapes, "qsgd-4bit", w) == 3 / 4 * up + 3 * down


@pytest.mark.slow
def test_bench_gpu_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    """The whole command at small sizes on the CPU (titled a CPU test run): every phase runs, every hook
    that runs on gloo is timed, and the modelled link time is the measured step plus bytes·8/rate,
    with the bytes those of :func:`wire_bytes` for the model's parameters."""
    from dqsgd.cli.bench.gpu import bench_gpu
    from dqsgd.cli.bench.gpu_step import RATES_GBIT, wire_bytes
    from dqsgd.cli.bench.loopback import build_model

    out = tmp_path / "r"
    args = parse_args(["bench", "gpu", "--out", str(out), "--device", "cpu", "--sizes", "20000", "--bits", "4",
                       "--torch-sizes", "0", "--rounds", "1", "--check-n", "3001", "--models", "transformer-small",
                       "--worlds", "2", "--ddp-rounds", "1", "--ddp-steps", "1", "--batch", "8", "--bucket-n", "5000",
                       "--host-rounds", "1", "--sim-models", "cnn", "--sim-steps", "1"])
    assert bench_gpu(args) == 0
    res = json.loads((out / "gpu.json").read_text())
    assert not res.get("errors") and {"correctness", "codec", "ddp", "host", "simulation"} <= set(res)
    rows = {r["hook"]: r for r in res["ddp"]["rows"]}
    assert set(rows) == {"none", "fp16", "powersgd-1", "powersgd-4", "qsgd-4bit", "dqsgd"}
    assert res["ddp"]["skipped"] == {"bf16": "PyTorch's bf16 hook runs on NCCL only"}
    shapes = [tuple(p.shape) for p in build_model("transformer-small")[0].parameters()]
    for link in res["ddp"]["link"]:
        step = rows[link["hook"]]
        assert link["bytes"] == step["bytes"] == wire_bytes(shapes, link["hook"], 2)
        for g in RATES_GBIT:
            assert link[f"ms_{g:g}g"] == step["ms"] + step["bytes"] * 8 / (g * 1e9) * 1e3
            base = next(b for b in res["ddp"]["link"] if b["hook"] == "none")
            assert link[f"vs_none_{g:g}g"] == link[f"ms_{g:g}g"] / base[f"ms_{g:g}g"]
    assert [h["world"] for h in res["host"]] == [2] and res["host"][0]["host_us_per_rank"] > 0
    codec = res["codec"][0]
    assert codec["both_gbs"] == 4 * 20000 / (codec["both_ms"] / 1e3) / 1e9
    md = (out / "gpu.md").read_text()
    assert md.startswith("# dqsgd bench gpu: CPU TEST RUN") and "Step modelled on a shaped inter-node link" in md
    assert "Not timed: bf16" in md and "Host time of one bucket's exchange" in md
