"""``dqsgd bench codec|step|compressors``: throughput, step overhead and compressor comparison.

Speeds are measured as ratios within one process (other jobs share the cores): every timed
operation is interleaved with ``out.copy_(g)`` into a preallocated buffer, repeated, and the best
of the repeats is kept for each. GB/s are of fp32 *input* bytes (4 per coordinate). Each command
prints a table and writes JSON (``--out``). Wire-up: :func:`dqsgd.bench_cli.add_bench_parser` adds the
sub-commands to an argparse sub-parser set (``benchmarks/bench_*.py`` call :func:`main`).
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

import numba
import numpy as np
import torch
import zstandard

from dqsgd.codecs import Coding, decode, elias_encode, encode, pack_bits, rans_encode
from dqsgd.codecs.threads import crc32, run_split
from dqsgd.codecs.wire import body_width, zstd_compress
from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast, quantize_uniform_fast, quantize_uniform_hash
from dqsgd.kernels import fused
from dqsgd.kernels.codec import MIN_CHUNKS_PER_THREAD, read_header
from dqsgd.kernels.device import decode_accumulate_device, encode_uniform_device, expected_header, set_compile
from dqsgd.kernels.hashrng import fill_hashes
from dqsgd.bench_cli import add_bench_parser, main  # noqa: F401  (the argparse wiring; kept importable here)
from dqsgd.quantizers import Norm, dequantize, levels_for_bits, quantize_uniform

__all__ = ["add_bench_parser", "bench_codec", "bench_compressors", "bench_step", "main", "best_of"]


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


def _threads(n: int) -> None:
    torch.set_num_threads(n)  # torch ops and the fused kernels (dqsgd.codecs.threads) both use n threads


def _print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    width = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, width)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, width)))


def _write(result: dict[str, Any], out: str | None) -> None:
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


# -------------------------------------------------------------------------------------- codec


def _torch_encode(g: torch.Tensor, bits: int, gen: torch.Generator, rng: HashRNG) -> bytes:
    """The production torch path: torch ops + torch.Generator (1 bit: the torch-ops hash reference)."""
    q = quantize_uniform(g, bits, gen) if bits >= 2 else quantize_uniform_hash(g, bits, rng)
    return encode(q)


def codec_speed_rows(n: int, bits_list: list[int], repeats: int, torch_repeats: int) -> list[dict[str, Any]]:
    g = torch.randn(n, generator=torch.Generator().manual_seed(n))
    out, buf = torch.zeros(n), torch.empty(n)
    gen, rng = torch.Generator().manual_seed(0), HashRNG(0, 0, 0)
    rows = []
    for bits in bits_list:
        pt, pf = _torch_encode(g, bits, gen, rng), encode_uniform_fast(g, bits, rng)
        best = best_of({"copy": lambda: buf.copy_(g), "fused_enc": lambda: encode_uniform_fast(g, bits, rng),
                        "fused_dec": lambda: decode_accumulate(pf, out)}, repeats)
        tbest = best_of({"copy": lambda: buf.copy_(g), "torch_enc": lambda: _torch_encode(g, bits, gen, rng),
                         "torch_dec": lambda: out.add_(dequantize(decode(pt)).reshape(-1))}, torch_repeats)
        for path, b in (("torch", tbest), ("fused", best)):
            enc, dec, cp = b[f"{path}_enc"], b[f"{path}_dec"], b["copy"]
            gbs = lambda t: 4 * n / t / 1e9  # noqa: E731
            rows.append({"n": n, "bits": bits, "path": path, "enc_GBs": gbs(enc), "dec_GBs": gbs(dec),
                         "encdec_GBs": gbs(enc + dec), "copy_GBs": gbs(cp), "encdec_vs_copy": cp / (enc + dec),
                         "enc_ms": 1e3 * enc, "dec_ms": 1e3 * dec, "copy_ms": 1e3 * cp, "payload_bytes": len(pf)})
    return rows


def _device(name: str) -> torch.device:
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
             "rans": 8 * len(rans_encode(codes, bits)) / n,
             "zstd19": 8 * len(zstandard.ZstdCompressor(level=19).compress(packed)) / n}
    sizes["auto"] = min(sizes["fixed"], sizes["elias"], sizes["zstd_aligned"], sizes["rans"])  # Coding.AUTO
    return sizes


def entropy_rows(bits_list: list[int]) -> list[dict[str, Any]]:
    lenet, _ = real_gradient()
    gauss = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))
    vectors = {"lenet-mnist grad": lenet, "gaussian 1M": gauss}
    rows = []
    for name, g in vectors.items():
        for norm in (Norm.MAX, Norm.L2):
            for bits in bits_list:
                codes = quantize_uniform_fast(g, bits, HashRNG(0, 0, 0), norm=norm).codes.numpy()
                h = level_entropy(codes)
                sizes = coded_sizes(codes, bits)
                best = min((k for k in sizes if k not in ("auto", "zstd19")), key=sizes.get)  # on the wire
                rows.append({"vector": name, "n": codes.size, "norm": norm.name.lower(), "bits": bits, "entropy": h,
                             **sizes, "best": best, "best_vs_entropy": sizes[best] / h if h else math.inf,
                             "zstd_vs_entropy": sizes["zstd"] / h if h else math.inf,
                             "zstd_aligned_vs_entropy": sizes["zstd_aligned"] / h if h else math.inf,
                             "elias_vs_entropy": sizes["elias"] / h if h else math.inf,
                             "rans_vs_entropy": sizes["rans"] / h if h else math.inf})
    return rows


@numba.njit(cache=True, nogil=True)
def _hashes_range(key, c_lo, c_hi):  # pragma: no cover - compiled
    """The fused encoder's uniforms alone: chunks [c_lo, c_hi) of hashes into an L1 buffer."""
    hbuf = np.empty(fused.CHUNK // 4, np.uint64)
    acc = np.uint64(0)
    for c in range(c_lo, c_hi):
        fill_hashes(key, c * fused.CHUNK, fused.CHUNK, hbuf)
        acc ^= hbuf[c & 255]
    return acc


def piece_rows(n: int, bits: int, repeats: int) -> list[dict[str, Any]]:
    """Each piece of the fused encode + decode-accumulate, timed alone against ``out.copy_(g)``."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(n))
    out, buf = torch.zeros(n), torch.empty(n)
    rng = HashRNG(0, 0, 0)
    payload = encode_uniform_fast(g, bits, rng)
    h = read_header(payload)
    body = np.frombuffer(payload, np.uint8)[h.body_start : h.body_start + h.body_len]
    pbody = np.empty_like(body)
    x, xb, starts = g.numpy(), g.numpy().view(np.int32), np.array([0, n], np.int64)
    inv, step = np.array([1.0], np.float32), np.array([1e-3], np.float32)
    sf, key, off, chunks = np.float32(levels_for_bits(bits)), np.uint64(rng.key), 1 << (bits - 1), -(-n // fused.CHUNK)
    split = {"min_per_thread": MIN_CHUNKS_PER_THREAD}
    pieces: dict[str, Callable[[], Any]] = {
        "copy": lambda: buf.copy_(g),
        "norm (max|g|)": lambda: run_split(fused.absmax_range, n, xb, starts, min_per_thread=split["min_per_thread"]
                                           * fused.CHUNK),
        "uniforms (hash)": lambda: run_split(_hashes_range, chunks, key, **split),
        "quantize+pack": lambda: run_split(fused.encode_range, chunks, x, starts, inv, sf, False, key, bits, off, pbody,
                                           **split),
        "crc32 of payload": lambda: crc32(payload),
        "payload to bytes": lambda: pbody.tobytes(),
        "encode (all)": lambda: encode_uniform_fast(g, bits, rng),
        "unpack+accumulate": lambda: run_split(fused.accumulate_range, chunks, body, bits, off, False, starts, step,
                                               np.float32(1), out.numpy(), **split),
        "decode_accumulate (all)": lambda: decode_accumulate(payload, out),
    }
    best = best_of(pieces, repeats)
    return [{"n": n, "bits": bits, "piece": k, "ms": 1e3 * t, "GBs": 4 * n / t / 1e9, "vs_copy": best["copy"] / t}
            for k, t in best.items()]


def bench_codec(args: argparse.Namespace) -> dict[str, Any]:
    _threads(args.threads)
    rows = []
    for n in args.sizes:
        rows += codec_speed_rows(n, args.bits, args.repeats, args.torch_repeats)
        rows += device_codec_rows(n, args.bits, args.repeats, _device(args.device), args.device_compile)
    print(f"codec throughput, GB/s of fp32 input; copy = out.copy_(g) in the same run; {args.threads} threads")
    _print_table(rows, ["n", "bits", "path", "enc_GBs", "dec_GBs", "encdec_GBs", "copy_GBs", "encdec_vs_copy"])
    print("(device-* rows: dqsgd.kernels.device on that device, copy = copy_ on the same device)")
    pieces = piece_rows(max(args.sizes), 4, args.repeats)
    print(f"\nthe pieces of the fused 4-bit path, each alone (vs_copy = copy time / piece time); {args.threads} threads")
    _print_table(pieces, ["n", "bits", "piece", "ms", "GBs", "vs_copy"])
    ent = entropy_rows([b for b in args.bits if 2 <= b <= 8] or [2, 4, 6, 8])
    print("\nbody bits per coordinate vs empirical entropy of the levels (zstd = Coding.ZSTD, zstd_aligned ="
          " Coding.ZSTD_ALIGNED, rans = Coding.RANS, auto = Coding.AUTO, zstd level 3; zstd19: a candidate, not on"
          " the wire)")
    _print_table(ent, ["vector", "norm", "bits", "entropy", "fixed", "elias", "zstd", "zstd_aligned", "rans", "auto",
                       "zstd19", "best", "best_vs_entropy"])
    result = {"throughput": rows, "pieces": pieces, "entropy": ent, "threads": args.threads}
    _write(result, args.out)
    return result


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
    _print_table(rows, ["method", "median_ms", "best_ms", "vs_sgd", "best_vs_sgd", "compute_ms", "encode_ms",
                        "comm+decode+update_ms"])
    result = {"config": args.config, "rows": rows, "steps": args.steps, "threads": args.threads}
    _write(result, args.out)
    return result


# -------------------------------------------------------------------------------- compressors


class _Bucket:
    """The part of ``dist.GradBucket`` the PyTorch hooks use: one flat buffer of all gradients."""

    def __init__(self, flat: torch.Tensor, shapes: list[torch.Size]):
        self._buf, self._shapes = flat.clone(), shapes

    def buffer(self) -> torch.Tensor:
        return self._buf

    def set_buffer(self, t: torch.Tensor) -> None:
        self._buf = t

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def gradients(self) -> list[torch.Tensor]:
        out, off = [], 0
        for s in self._shapes:
            k = math.prod(s)
            out.append(self._buf[off : off + k].view(s))
            off += k
        return out


def _pertensor(t: torch.Tensor) -> torch.Tensor:
    """quantization_pertensor_hook's math: MinMaxObserver qparams, uint8 round trip."""
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as qh

    obs = torch.ao.quantization.MinMaxObserver()
    obs(t)
    scale, zero = obs.calculate_qparams()
    return qh._dequantize_per_tensor_backend(qh._quantize_per_tensor_backend(t, scale, zero), scale, zero)


_Case = tuple[Callable[[], torch.Tensor], Callable[[], int]]  # (encode+decode once → Q(g), bytes sent)


def _torch_hooks(g: torch.Tensor, shapes: list[torch.Size]) -> dict[str, _Case]:
    """PyTorch's compression hooks on a 1-process gloo group: name → (run, bytes sent)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pg = dist.group.WORLD
    hooks: dict[str, _Case] = {
        "torch fp16_compress_hook": (lambda: default_hooks.fp16_compress_hook(pg, _Bucket(g, shapes)).wait(),
                                     lambda: 2 * g.numel()),  # fp16 per coordinate (allreduce payload)
        # The hook itself fails here (IndexError in quantize_and_allgather on the all_gather future's
        # value, torch 2.13, 1-process gloo): its own quantize/dequantize functions, applied directly.
        "torch quantization_pertensor (hook math)": (lambda: _pertensor(g), lambda: g.numel() + 8),
    }
    for rank in (1, 4):
        state = {}

        def run(rank: int = rank, state: dict = state) -> torch.Tensor:
            st = powerSGD_hook.PowerSGDState(pg, matrix_approximation_rank=rank, start_powerSGD_iter=0,
                                             use_error_feedback=False, warm_start=False)
            state["st"] = st
            return powerSGD_hook.powerSGD_hook(st, _Bucket(g, shapes)).wait()

        hooks[f"torch powerSGD rank {rank}"] = (run, lambda state=state: 4 * state["st"].total_numel_after_compression)
    return hooks


def bench_compressors(args: argparse.Namespace) -> dict[str, Any]:
    from dqsgd.methods import method_config
    from dqsgd.pipeline import Method

    _threads(args.threads)
    g, shapes = real_gradient(args.model, args.dataset, args.batch)
    n, norm = g.numel(), float(g.norm())
    sizes = [math.prod(s) for s in shapes]
    cases: dict[str, _Case] = {}
    specs = [("sgd", {}), ("qsgd-2bit", {}), ("qsgd-4bit", {}), ("qsgd-8bit", {}), ("dqsgd", {}), ("terngrad", {}),
             ("signsgd", {}), ("qsgd-4bit", {"kernel": "fused"}), ("dqsgd", {"kernel": "fused"})]
    for name, over in specs:
        m = Method(method_config(name, **over), n, 100, sizes)
        bits = m.init_state(1).bits
        gen, rng = torch.Generator().manual_seed(0), HashRNG(0, 0, 0)
        scalers = m.local_scalers(g) if m.shares_scalers else None
        last: dict[str, bytes] = {}

        def run(m: Method = m, bits: int = bits, gen=gen, rng=rng, scalers=scalers, last=last) -> torch.Tensor:
            last["p"] = m.encode(g, bits, None if m.fused else gen, None, scalers, hash_rng=rng if m.fused else None)[0]
            return m.aggregate([last["p"]], bits)

        label = f"dqsgd:{name}" + (" fused" if over else "")
        label += f" ({bits} bits)" if m.config.scheme == "uniform" else ""
        cases[label] = (run, lambda last=last: len(last["p"]))
    cases.update(_torch_hooks(g, shapes))
    rows = []
    for label, (run, nbytes) in cases.items():
        approx = run()
        t = best_of({"x": run}, args.repeats)["x"]
        rows.append({"compressor": label, "bytes": nbytes(), "ratio": 4 * n / nbytes(),
                     "rel_error": float((approx.reshape(-1) - g).norm()) / norm, "encdec_ms": 1e3 * t})
    print(f"compressors on one {args.model}/{args.dataset} gradient ({n} coordinates, batch {args.batch}); "
          "ratio = fp32 bytes / bytes sent; encode+decode includes a 1-process collective for the torch hooks")
    _print_table(rows, ["compressor", "bytes", "ratio", "rel_error", "encdec_ms"])
    result = {"n": n, "model": args.model, "dataset": args.dataset, "rows": rows}
    _write(result, args.out)
    return result


# ------------------------------------------------------------------------------------ network


def bench_network(args: argparse.Namespace) -> int:
    """Run benchmarks/network/bench_network.py (it lives in the source checkout, not the wheel)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "network" / "bench_network.py"
    if not script.exists():
        print(f"dqsgd bench network: {script} not found; run it from a source checkout of dqsgd")
        return 2
    spec = importlib.util.spec_from_file_location("bench_network", script)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return int(mod.main(args.rest) or 0)
