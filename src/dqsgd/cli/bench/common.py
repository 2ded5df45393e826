"""What the ``dqsgd bench`` commands share, and ``dqsgd bench step``: timing, tables, JSON, real gradients.

Speeds are measured as ratios within one process (other jobs share the cores): every timed
operation is interleaved with ``out.copy_(g)`` into a preallocated buffer, repeated, and the best
of the repeats is kept for each. GB/s are of fp32 *input* bytes (4 per coordinate). Each command
prints a table and writes JSON (``--out``).

This module uses dqsgd's public API only. ``dqsgd bench codec`` (which times the fused kernel's
pieces with a numba kernel of its own) and ``dqsgd bench compressors`` (which calls PyTorch's DDP
hooks and their private quantization backend) live in the source checkout's ``benchmarks/``
and import the helpers from here; :mod:`dqsgd.cli.bench.parser` wires all the sub-commands.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import zstandard

from dqsgd.codecs import Coding, elias_encode, pack_bits, rans_encode, ransx_encode
from dqsgd.codecs.auto import rans_candidate
from dqsgd.codecs.wire import body_width, zstd_compress
from dqsgd.kernels import HashRNG
from dqsgd.kernels.device import decode_accumulate_device, encode_uniform_device, expected_header, set_compile

__all__ = ["bench_step", "best_of", "coded_sizes", "device_codec_rows", "level_entropy", "pick_device",
           "print_table", "real_gradient", "set_threads", "write_result"]


# ------------------------------------------------------------------------------------ helpers


def best_of(fns: dict[str, Callable[[], Any]], repeats: int, copy_factor: int = 4) -> dict[str, float]:
    """Best wall time (s) of each callable over ``repeats`` interleaved rounds.

    A callable named "copy" (the baseline) runs ``copy_factor`` times per round: its best is
    then the closer to the machine's real peak, so ratios against it err on the low side.
    """
    best = {k: math.inf for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            for _ in range(copy_factor if k == "copy" else 1):
                t = time.perf_counter()
                f()
                best[k] = min(best[k], time.perf_counter() - t)
    return best


def set_threads(n: int) -> None:
    torch.set_num_threads(n)  # torch ops and the fused kernels (dqsgd.codecs.threads) both use n threads


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    width = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, width)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, width)))


def write_result(result: dict[str, Any], out: str | None) -> None:
    import numba

    result["machine"] = {"torch_threads": torch.get_num_threads(), "loadavg_1m": os.getloadavg()[0],
                         "python": platform.python_version(), "torch": torch.__version__,
                         "numba": numba.__version__, "processor": platform.processor() or platform.machine()}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")


def real_gradient(model: str = "cnn", dataset: str = "mnist", batch: int = 32, seed: int = 0
                  ) -> tuple[torch.Tensor, list[torch.Size]]:
    """One minibatch gradient of a freshly initialised model (flat, and the parameter shapes)."""
    import torch.nn.functional as F

    from dqsgd.data import load_dataset
    from dqsgd.models import build_model

    data = load_dataset(dataset)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = build_model(model, data)
    idx = torch.randperm(len(data.train.y), generator=torch.Generator().manual_seed(seed))[:batch]
    params = [p for p in net.parameters() if p.requires_grad]
    grads = torch.autograd.grad(F.cross_entropy(net(data.train.x[idx]), data.train.y[idx]), params)
    return torch.cat([g.reshape(-1) for g in grads]).detach(), [p.shape for p in params]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    return torch.device(name)


def device_codec_rows(n: int, bits_list: list[int], repeats: int, device: torch.device,
                      compiled: bool | None = None) -> list[dict[str, Any]]:
    """The device codec (:mod:`dqsgd.kernels.device`: compiled on CUDA, eager torch ops on CPU, or as
    ``compiled`` says) against ``out.copy_(g)`` on the same device; encode and decode run with deferred
    checks and decode with the expected header: no host sync, as in a DDP hook."""
    set_compile(compiled)
    try:
        label = "" if compiled is None else "-compiled" if compiled else "-eager"
        return [_device_row(n, bits, repeats, device, label) for bits in bits_list]
    finally:
        set_compile(None)


def _device_row(n: int, bits: int, repeats: int, device: torch.device, label: str) -> dict[str, Any]:
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device)
    out, buf, bad = torch.zeros_like(g), torch.empty_like(g), torch.zeros((), dtype=torch.bool, device=device)
    rng, sync = HashRNG(0, 0, 0), (torch.cuda.synchronize if device.type == "cuda" else lambda: None)
    hdr, p = expected_header((n,), bits), encode_uniform_device(g, bits, rng)
    fns = {"copy": lambda: buf.copy_(g), "enc": lambda: encode_uniform_device(g, bits, rng, check="defer"),
           "dec": lambda: decode_accumulate_device(p, out, header=hdr, check="defer", bad=bad)}
    for f in fns.values():  # warm-up (and compilation)
        f()
    best = best_of({k: (lambda f=f: (f(), sync())) for k, f in fns.items()}, repeats)
    enc, dec, cp = best["enc"], best["dec"], best["copy"]
    return {"n": n, "bits": bits, "path": f"device-{device.type}{label}", "enc_GBs": 4 * n / enc / 1e9,
            "dec_GBs": 4 * n / dec / 1e9, "encdec_GBs": 4 * n / (enc + dec) / 1e9, "copy_GBs": 4 * n / cp / 1e9,
            "enc_vs_copy": cp / enc, "dec_vs_copy": cp / dec, "encdec_vs_copy": cp / (enc + dec),
            "enc_ms": 1e3 * enc, "dec_ms": 1e3 * dec, "copy_ms": 1e3 * cp, "payload_bytes": p.numel()}


def level_entropy(codes: np.ndarray) -> float:
    """Empirical (order-0) entropy of the integer levels, bits per coordinate."""
    counts = np.bincount(codes.astype(np.int64) - int(codes.min())) if codes.size else np.zeros(0)
    p = counts[counts > 0] / max(codes.size, 1)
    return float(-(p * np.log2(p)).sum())


def coded_sizes(codes: np.ndarray, bits: int) -> dict[str, float]:
    """Body bits per coordinate of each coding on the wire, and zstd level 19 (a candidate only)."""
    n = codes.size
    off = 1 << (bits - 1)
    packed = pack_bits(codes, bits, offset=off)
    aligned = pack_bits(codes, body_width(bits, Coding.ZSTD_ALIGNED), offset=off)  # Coding.ZSTD_ALIGNED's body
    sizes = {"fixed": 8 * len(packed) / n, "elias": 8 * len(elias_encode(codes)) / n,
             "zstd": 8 * len(zstd_compress(packed)) / n, "zstd_aligned": 8 * len(zstd_compress(aligned)) / n,
             "rans": 8 * len(rans_encode(codes, bits)) / n, "ransx": 8 * len(ransx_encode(codes, bits)) / n,
             "zstd19": 8 * len(zstandard.ZstdCompressor(level=19).compress(packed)) / n}
    rans = "ransx" if rans_candidate(n) == Coding.RANSX else "rans"
    sizes["auto"] = min(sizes["fixed"], sizes["elias"], sizes["zstd_aligned"], sizes[rans])  # Coding.AUTO
    return sizes


# --------------------------------------------------------------------------------------- step


def _trainer(exp: Any, label: str, kernel: str | None, data: Any, seed: int, vmap: bool = False) -> Any:
    import dataclasses

    from dqsgd.train.trainer import Trainer

    entry = next(e for e in exp.methods if e.label == label)
    if kernel is not None:
        entry = dataclasses.replace(entry, config=dataclasses.replace(entry.config, kernel=kernel))
    return Trainer(dataclasses.replace(exp.train, vmap_workers=vmap), entry, data, seed)  # kernel "fused": it passes HashRNG(seed_for(seed, QUANT), n, w)


def bench_step(args: argparse.Namespace) -> dict[str, Any]:
    from dqsgd.data import load_dataset
    from dqsgd.train.config import load_experiment

    exp = load_experiment(args.config, [f"train.threads={args.threads}"])
    data = load_dataset(exp.train.dataset)
    runs = {"sgd": ("sgd", None, False), "dqsgd (torch)": ("dqsgd", "torch", False),
            "dqsgd (fused)": ("dqsgd", "fused", False), "sgd (vmap workers)": ("sgd", None, True),
            "dqsgd (fused, vmap workers)": ("dqsgd", "fused", True)}
    trainers = {name: _trainer(exp, label, kernel, data, 0, vmap) for name, (label, kernel, vmap) in runs.items()}
    times: dict[str, list[float]] = {k: [] for k in trainers}
    parts: dict[str, list[tuple[float, float, float]]] = {k: [] for k in trainers}
    for i in range(args.warmup + args.steps):
        for name, tr in trainers.items():  # interleaved, so the machine's load hits all alike
            t = time.perf_counter()
            r = tr.step()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
                parts[name].append((r.compute_s, r.encode_s, r.decode_s))
    base = float(np.median(times["sgd"]))
    rows = []
    for name, ts in times.items():
        med = float(np.median(ts))
        p = np.median(np.array(parts[name]), axis=0)
        rows.append({"method": name, "median_ms": 1e3 * med, "best_ms": 1e3 * min(ts), "vs_sgd": med / base,
                     "best_vs_sgd": min(ts) / min(times["sgd"]), "compute_ms": 1e3 * p[0], "encode_ms": 1e3 * p[1],
                     "comm+decode+update_ms": 1e3 * p[2]})
    t = exp.train
    print(f"Trainer.step(), config {args.config}: model {t.model}, W = {t.workers}, batch {t.batch_size}/worker, "
          f"{args.steps} steps after {args.warmup} warm-up, {args.threads} torch thread(s); sim transport")
    print_table(rows, ["method", "median_ms", "best_ms", "vs_sgd", "best_vs_sgd", "compute_ms", "encode_ms",
                        "comm+decode+update_ms"])
    result = {"config": args.config, "rows": rows, "steps": args.steps, "threads": args.threads}
    write_result(result, args.out)
    return result
