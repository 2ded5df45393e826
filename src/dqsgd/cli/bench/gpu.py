"""``dqsgd bench gpu --out DIR``: the GPU path measured in one command; writes ``gpu.json`` and ``gpu.md``.

Sections (each a function here or in :mod:`dqsgd.cli.bench.loopback`):

* environment — GPU, torch, Triton, CUDA and numba versions, the command line, the time;
* correctness — on the device, for widths 1, 2, 4, 8, 16 and both norms: payload bytes against the
  CPU (numba) kernels', decoded sums bitwise, a corrupted payload refused;
* codec speed — encode, decode-accumulate and both, as a ratio to ``copy_`` of the same tensor in
  the same round (interleaved rounds, median), for the Triton kernels, the torch-ops codec
  (``torch.compile``) and, for reference, the host (numba) path;
* DDP loopback step time per model and W of no hook, fp16, bf16, PowerSGD ranks 1 and 4, qsgd-4bit
  and dqsgd, the bytes each sends, the step modelled on a 10/25/100 Gbit/s link, recompilations and
  peak memory (:mod:`dqsgd.cli.bench.gpu_step`, on :mod:`dqsgd.cli.bench.loopback`);
* host time of one bucket's exchange per rank (:func:`dqsgd.cli.bench.gpu_step.host_times`);
* simulation steps per second (W = 8 workers on the device) against plain SGD.

Only torch, numba and (for its rows) Triton are needed; the data is synthetic. On a machine
without CUDA it says so in one line and exits 2. ``--device cpu`` exists for the test suite: it
runs every section on the CPU at the sizes given, and the report's title says that these are CPU
figures, never GPU ones.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["bench_gpu", "codec_speed", "correctness", "environment", "simulation", "write_report"]

CHECK_BITS = (1, 2, 4, 8, 16)
PATHS = ("triton", "torch-ops", "host")


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def environment(device: torch.device) -> dict[str, Any]:
    import numba

    from dqsgd.kernels.device_common import triton_available

    env = {"device": device.type, "torch": torch.__version__, "cuda": torch.version.cuda, "numba": numba.__version__,
           "python": platform.python_version(), "command": " ".join(["dqsgd", *sys.argv[1:]]),
           "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "processor": platform.processor() or platform.machine(), "triton": None}
    if triton_available():
        import triton

        env["triton"] = triton.__version__
    return env


L2_SCALE_RTOL = 1e-5  # the l2 scales' largest relative device-host gap that still counts as agreement


def correctness(device: torch.device, n: int) -> list[dict[str, Any]]:
    """Per (width, norm): the device payload against the host's, its decode on the device against the
    host's decode of the *same* payload, and a corrupted copy refused.

    Claimed bitwise: the payload bytes for the max norm. The l2 norm is a float reduction whose order
    differs across devices, so its scales may differ in the last bits (and a code may then round the other
    way): for l2 the payload bytes are reported, not claimed, and ``scale_rel`` (the largest relative
    gap of the scales) must stay within ``L2_SCALE_RTOL``. Decoding is bitwise for both norms."""
    from dqsgd.codecs import PayloadError
    from dqsgd.codecs.wire import read_header
    from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast
    from dqsgd.kernels.device import decode_accumulate_device, encode_uniform_device
    from dqsgd.kernels.device_common import use_triton
    from dqsgd.quantizers import Layout, Norm

    rows, layout = [], Layout(bucket=4096)
    for bits in CHECK_BITS:
        for norm in (Norm.MAX, Norm.L2):
            x = torch.randn(n, generator=torch.Generator().manual_seed(bits))
            rng = HashRNG(1, bits, 2)
            p = encode_uniform_device(x.to(device), bits, rng, norm=norm, layout=layout)
            got = bytes(p.cpu().numpy())
            ref = encode_uniform_fast(x, bits, rng, norm=norm, layout=layout)
            s_dev, s_host = read_header(got).scales, read_header(ref).scales
            out, want = torch.zeros(n, device=device), torch.zeros(n)
            decode_accumulate_device(p, out)
            decode_accumulate(got, want)
            bad = p.clone()
            bad[-5] ^= 0x01
            try:
                decode_accumulate_device(bad, torch.zeros(n, device=device))
                refused = False
            except PayloadError:
                refused = True
            rows.append({"bits": bits, "norm": norm.name.lower(), "kernels": "triton" if use_triton(device) else
                         "torch-ops", "claimed": "bytes" if norm == Norm.MAX else "decode, scales",
                         "bytes_equal": got == ref, "scale_rel": float(abs(s_dev - s_host).max() / s_host.max()),
                         "decode_bitwise": torch.equal(out.cpu(), want), "corrupt_refused": refused})
    return rows


def _codec_fns(path: str, x: torch.Tensor, bits: int) -> dict[str, Callable[[], Any]]:
    """copy / enc / dec / both callables of one codec path on ``x``."""
    from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast
    from dqsgd.kernels.device import decode_accumulate_device, encode_uniform_device, expected_header

    rng, n = HashRNG(3, 1, 0), x.numel()
    buf, out = torch.empty_like(x), torch.zeros_like(x)
    if path == "host":
        p = encode_uniform_fast(x, bits, rng)
        return {"copy": lambda: buf.copy_(x), "enc": lambda: encode_uniform_fast(x, bits, rng),
                "dec": lambda: decode_accumulate(p, out),
                "both": lambda: decode_accumulate(encode_uniform_fast(x, bits, rng), out)}
    hdr, bad = expected_header((n,), bits), torch.zeros((), dtype=torch.bool, device=x.device)
    p = encode_uniform_device(x, bits, rng, check="defer")

    def enc() -> torch.Tensor:
        return encode_uniform_device(x, bits, rng, check="defer")

    def dec(q: torch.Tensor) -> None:
        decode_accumulate_device(q, out, header=hdr, check="defer", bad=bad)

    return {"copy": lambda: buf.copy_(x), "enc": enc, "dec": lambda: dec(p), "both": lambda: dec(enc())}


def _ratios(fns: dict[str, Callable[[], Any]], sync: Callable[[], None], rounds: int) -> dict[str, Any]:
    """Median over interleaved rounds of t_copy / t_op (1 = as fast as copy_), and the ms."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds + 1):  # the first round warms up (compilation, caches)
        for k, f in fns.items():
            sync()
            t = time.perf_counter()
            f()
            sync()
            times[k].append(time.perf_counter() - t)
    row: dict[str, Any] = {}
    for k in ("enc", "dec", "both"):
        r = [c / t for c, t in zip(times["copy"][1:], times[k][1:])]
        row[k] = statistics.median(r)
        row[f"{k}_ms"] = 1e3 * statistics.median(times[k][1:])
    row["copy_ms"] = 1e3 * statistics.median(times["copy"][1:])
    return row


def _gbs(row: dict[str, Any], n: int) -> dict[str, Any]:
    """GB/s of float32 input (4n bytes) through each op: copy_, encode, decode, encode + decode."""
    return {**row, **{f"{k}_gbs": 4 * n / (row[f"{k}_ms"] / 1e3) / 1e9 for k in ("copy", "enc", "dec", "both")}}


def _triton_runs(device: torch.device) -> bool:
    """Triton kernels run on CUDA, or on the CPU under its interpreter (tests)."""
    from dqsgd.kernels.device_common import triton_available

    return triton_available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def codec_speed(device: torch.device, sizes: list[int], bits_list: list[int], rounds: int,
                torch_sizes: list[int], torch_bits: list[int]) -> list[dict[str, Any]]:
    """Rows (path, n, bits, enc, dec, both as ratios to copy_); torch-ops only at ``torch_sizes`` and
    ``torch_bits`` (its graphs compile per shape and width: tens of seconds each on a GPU)."""
    from dqsgd.kernels.device_common import set_triton

    rows = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device)
        xh = x.cpu()
        for bits in bits_list:
            for path in PATHS:
                skip = {"triton": not _triton_runs(device), "host": False,
                        "torch-ops": n not in torch_sizes or bits not in torch_bits}
                if skip[path]:
                    continue
                set_triton(path == "triton" if path != "host" else None)
                try:
                    fns = _codec_fns(path, xh if path == "host" else x, bits)
                    sync = _sync(torch.device("cpu") if path == "host" else device)
                    rows.append({"path": path, "n": n, "bits": bits, **_gbs(_ratios(fns, sync, rounds), n)})
                finally:
                    set_triton(None)
    return rows


def simulation(device: torch.device, models: list[str], steps: int, warmup: int = 2, workers: int = 8,
               methods: tuple[str, ...] = ("sgd", "qsgd-4bit", "dqsgd")) -> list[dict[str, Any]]:
    """Simulated training steps per second (all ``workers`` workers of one step on ``device``), per
    model and method of ``table1-mnist``, on synthetic 3×32×32 data, interleaved; ``vs_sgd`` =
    method step time / plain SGD step time."""
    import dataclasses

    from dqsgd.data.base import Dataset, Split
    from dqsgd.train.config import load_experiment
    from dqsgd.train.trainer import Trainer

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1024, 3, 32, 32, generator=g), torch.randint(0, 10, (1024,), generator=g)
    data = Dataset("synthetic", Split(x, y), Split(x[:128], y[:128]), 10, (3, 32, 32), "image",
                   note="Gaussian noise in CIFAR's shape: a timing input only")
    sync, rows = _sync(device), []
    for model in models:
        # coded_every = 0: no best-coding measurement (a measurement beside the step, and it needs zstandard)
        sets = [f"train.model={model}", f"train.workers={workers}", "train.coded_every=0"]
        exp = load_experiment("table1-mnist", sets)
        trainers = {e.label: Trainer(dataclasses.replace(exp.train, dataset="synthetic"), e, data, 0, device=device)
                    for e in exp.methods if e.label in methods}
        times: dict[str, list[float]] = {k: [] for k in trainers}
        for i in range(warmup + steps):
            for k, tr in trainers.items():
                sync()
                t = time.perf_counter()
                tr.step()
                sync()
                if i >= warmup:
                    times[k].append(time.perf_counter() - t)
        base = statistics.median(times["sgd"])
        rows += [{"model": model, "method": k, "steps_per_s": 1 / statistics.median(ts),
                  "vs_sgd": statistics.median(ts) / base} for k, ts in times.items()]
    return rows


# --------------------------------------------------------------------------------------- report


def _table(rows: list[dict[str, Any]], cols: list[str]) -> list[str]:
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
            *("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows)]


def write_report(result: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """``gpu.json`` (everything) and ``gpu.md`` (tables) in ``out``; CPU runs are titled as such."""
    out.mkdir(parents=True, exist_ok=True)
    env = result["environment"]
    cpu = env["device"] != "cuda"
    title = ("# dqsgd bench gpu: CPU TEST RUN (not GPU figures; GPU not measured)" if cpu
             else f"# dqsgd bench gpu on {env['gpu']}")
    lines = [title, "", f"`{env['command']}`, {env['utc']} UTC; torch {env['torch']}, CUDA {env['cuda']}, "
             f"Triton {env['triton'] or 'not installed'}, numba {env['numba']}, Python {env['python']}.", ""]
    if "correctness" in result:
        lines += ["## Correctness on the device (against the CPU kernels)", "",
                  *_table(result["correctness"], ["bits", "norm", "kernels", "claimed", "bytes_equal", "scale_rel",
                                                  "decode_bitwise", "corrupt_refused"]), "",
                  "`claimed`: what must agree bitwise. The l2 scales are a float reduction whose order differs "
                  "across devices: their relative gap (`scale_rel`) must stay within "
                  f"{L2_SCALE_RTOL:g}, and the payload's bytes are reported, not claimed.", ""]
    if "codec" in result:
        lines += ["## Codec speed, as a ratio to `copy_` of the same tensor (1 = as fast as copy_)", "",
                  *_table(result["codec"], ["path", "n", "bits", "enc", "dec", "both", "copy_ms", "both_ms",
                                            "copy_gbs", "both_gbs"]), "",
                  "`*_gbs`: GB/s of float32 input (4n bytes) through copy_ and through encode + decode.", ""]
    lines += _step_lines(result, cpu)
    if "simulation" in result:
        lines += ["## Simulation steps per second (W = 8 workers on the device; vs_sgd = step time / SGD's)", "",
                  *_table(result["simulation"], ["model", "method", "steps_per_s", "vs_sgd"]), ""]
    if result.get("errors"):
        lines += ["## Phases that failed", "", *(f"- {k}: `{v}`" for k, v in result["errors"].items()), ""]
    js, md = out / "gpu.json", out / "gpu.md"
    js.write_text(json.dumps(result, indent=1))
    md.write_text("\n".join(lines))
    return js, md


def _step_lines(result: dict[str, Any], cpu: bool) -> list[str]:
    """The step, link and host-time sections of gpu.md."""
    note = " (CPU test run: GPU not measured)" if cpu else ""
    lines: list[str] = []
    if "ddp" in result:
        d = result["ddp"]
        rec = ", ".join(f"{k} {'n/a (interpreter: nothing compiled)' if v is None else v}"
                        for k, v in d["recompilations"].items()) if isinstance(d["recompilations"], dict) \
            else str(d["recompilations"])
        lines += [f"## DDP step time, loopback (ratio to no hook: median [min, max] over rounds){note}", "",
                  *_table(d["rows"], ["model", "world", "hook", "ms", "ratio", "min", "max", "bytes",
                                      "peak_mb_over_none"]), "",
                  f"Recompilations after warm-up: {rec}.", "",
                  *(f"Not timed: {h} ({why})." for h, why in d.get("skipped", {}).items()), ""]
        if "link" in d:
            cols = ["model", "world", "hook", "bytes"] + [c for c in d["link"][0] if c.startswith(("ms_", "vs_"))]
            lines += [f"## Step modelled on a shaped inter-node link{note}", "", *_table(d["link"], cols), "",
                      "`ms_<r>g` = the measured loopback step + bytes·8 / (r Gbit/s): the bytes one rank sends per "
                      "step (`bytes`), no overlap with the backward pass assumed; `vs_none_<r>g`: over no hook's "
                      "at the same rate.", ""]
    if "host" in result:
        lines += [f"## Host time of one bucket's exchange (sharded, both legs, all shards){note}", "",
                  *_table(result["host"], ["method", "world", "numel", "host_us_per_rank", "wall_us"]), "",
                  "`host_us_per_rank`: the exchange of W in-process ranks timed without a synchronize, over W." +
                  (" On the CPU the kernels run on the host: not a host-time figure." if cpu else ""), ""]
    return lines


def _device(args: argparse.Namespace) -> torch.device | None:
    if args.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print("dqsgd bench gpu: no CUDA device here (torch.cuda.is_available() is False): GPU not measured")
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _mismatches(result: dict[str, Any]) -> list[str]:
    """What the report shows wrong: a failed phase, or a correctness row that is not all True."""
    bad = [f"{k}: {v}" for k, v in result.get("errors", {}).items()]
    for r in result.get("correctness", []):
        what = f"correctness bits={r['bits']} norm={r['norm']}"
        checks = ("bytes_equal", "decode_bitwise", "corrupt_refused") if r["claimed"] == "bytes" else \
            ("decode_bitwise", "corrupt_refused")
        bad += [f"{what}: {c} is False" for c in checks if not r[c]]
        if r["claimed"] != "bytes" and not r["scale_rel"] <= L2_SCALE_RTOL:
            bad.append(f"{what}: scales differ by {r['scale_rel']:.3g} (relative) > {L2_SCALE_RTOL}")
    return bad


def bench_gpu(args: argparse.Namespace) -> int:
    """The command: 2 without a GPU (one line said); else the report is rewritten after every phase (a
    phase that raises is recorded under ``errors`` and the next one runs), and the exit code is 0 only
    if every phase ran and every correctness check held (1 otherwise, each failure named)."""
    device = _device(args)
    if device is None:
        return 2
    from dqsgd.cli.bench.gpu_step import host_times, step_times

    out = Path(args.out)
    result: dict[str, Any] = {"environment": environment(device)}
    phases = (("correctness", f"correctness ({args.check_n} elements)", lambda: correctness(device, args.check_n)),
              ("codec", "codec speed", lambda: codec_speed(device, args.sizes, args.bits, args.rounds,
                                                           args.torch_sizes, args.torch_bits)),
              ("ddp", "DDP loopback", lambda: step_times(device, args.models, args.worlds, args.ddp_rounds,
                                                         args.ddp_steps, args.batch)),
              ("host", "host time per bucket", lambda: host_times(device, args.worlds, args.bucket_n,
                                                                   args.host_rounds)),
              ("simulation", "simulation", lambda: simulation(device, args.sim_models, args.sim_steps)))
    for key, what, run in phases:
        print(f"bench gpu: {what} ...", flush=True)
        t = time.perf_counter()
        try:
            result[key] = run()
        except Exception as e:  # noqa: BLE001 - recorded in the report and in the exit code, not swallowed
            result.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"
            print(f"bench gpu: {what} FAILED: {type(e).__name__}: {e}", flush=True)
        result.setdefault("seconds", {})[key] = round(time.perf_counter() - t, 1)
        js, md = write_report(result, out)
    print(md.read_text())
    print(f"wrote {js} and {md}")
    bad = _mismatches(result)
    for line in bad:
        print(f"bench gpu: FAILED {line}")
    return 1 if bad else 0
