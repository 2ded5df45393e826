"""``dqsgd bench codec``: encode/decode GB/s against a copy, the fused path's pieces, coded bits vs entropy.

Run as ``dqsgd bench codec [options]`` from a source checkout, or as
``python benchmarks/bench_codec.py [--out FILE] [options]`` (see ``--help``). The table is printed and
the JSON goes to ``--out``. It lives here, not in the package, because it times the fused kernel's
internal pieces with a numba kernel of its own (``_hashes_range``); the shared helpers come from
:mod:`dqsgd.cli.bench.common`.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable

import numba
import numpy as np
import torch

from dqsgd.cli.bench.common import (best_of, coded_sizes, device_codec_rows, level_entropy, pick_device, print_table,
                         real_gradient, set_threads, write_result)
from dqsgd.codecs import decode, encode, rans_decode, rans_encode, ransx_decode, ransx_encode
from dqsgd.codecs.rans import level_histogram
from dqsgd.codecs.threads import crc32, run_split
from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast, quantize_uniform_fast, quantize_uniform_hash
from dqsgd.kernels import fused
from dqsgd.kernels.codec import MIN_CHUNKS_PER_THREAD, read_header
from dqsgd.kernels.hashrng import fill_hashes
from dqsgd.quantizers import Norm, dequantize, levels_for_bits, quantize_uniform


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


def rans_rows(n: int, bits_list: list[int], repeats: int) -> list[dict[str, Any]]:
    """ns per code of encoding (the histogram given, as AUTO does) and decoding with RANS and RANSX, on the
    max-norm levels of a Gaussian (hash uniforms): the codes AUTO sees from a dense gradient."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(n))
    rows = []
    for bits in bits_list:
        codes = quantize_uniform_fast(g, bits, HashRNG(0, 0, 0), norm=Norm.MAX).codes.numpy()
        hist, lo, hi = level_histogram(codes, bits), -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        p = hist[hist > 0] / n
        for name, enc, dec in (("rans", rans_encode, rans_decode), ("ransx", ransx_encode, ransx_decode)):
            body = enc(codes, bits, hist)
            assert np.array_equal(dec(body, n, bits, lo, hi, True), codes)
            best = best_of({"enc": lambda: enc(codes, bits, hist), "dec": lambda: dec(body, n, bits, lo, hi, True)},
                           repeats)
            rows.append({"n": n, "bits": bits, "coder": name, "entropy": float(-(p * np.log2(p)).sum()),
                         "body_bits": 8 * body.size / n, "enc_ns": 1e9 * best["enc"] / n,
                         "dec_ns": 1e9 * best["dec"] / n})
    return rows


def bench_rans(args: argparse.Namespace) -> dict[str, Any]:
    """``--rans-only``: the two rANS coders' ns per code, nothing else."""
    set_threads(args.threads)
    rows = [r for n in args.sizes for r in rans_rows(n, [b for b in args.bits if 2 <= b <= 16], args.repeats)]
    print(f"rANS coders, ns per code (best of {args.repeats}; encode with the histogram given, decode with its checks)")
    print_table(rows, ["n", "bits", "coder", "entropy", "body_bits", "enc_ns", "dec_ns"])
    result = {"rans": rows, "threads": args.threads}
    write_result(result, args.out)
    return result


def bench_codec(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "rans_only", False):
        return bench_rans(args)
    set_threads(args.threads)
    rows = []
    for n in args.sizes:
        rows += codec_speed_rows(n, args.bits, args.repeats, args.torch_repeats)
        rows += device_codec_rows(n, args.bits, args.repeats, pick_device(args.device), args.device_compile)
    print(f"codec throughput, GB/s of fp32 input; copy = out.copy_(g) in the same run; {args.threads} threads")
    print_table(rows, ["n", "bits", "path", "enc_GBs", "dec_GBs", "encdec_GBs", "copy_GBs", "encdec_vs_copy"])
    print("(device-* rows: dqsgd.kernels.device on that device, copy = copy_ on the same device)")
    pieces = piece_rows(max(args.sizes), 4, args.repeats)
    print(f"\nthe pieces of the fused 4-bit path, each alone (vs_copy = copy time / piece time); {args.threads} threads")
    print_table(pieces, ["n", "bits", "piece", "ms", "GBs", "vs_copy"])
    ent = entropy_rows([b for b in args.bits if 2 <= b <= 8] or [2, 4, 6, 8])
    print("\nbody bits per coordinate vs empirical entropy of the levels (zstd = Coding.ZSTD, zstd_aligned ="
          " Coding.ZSTD_ALIGNED, rans = Coding.RANS, auto = Coding.AUTO, zstd level 3; zstd19: a candidate, not on"
          " the wire)")
    print_table(ent, ["vector", "norm", "bits", "entropy", "fixed", "elias", "zstd", "zstd_aligned", "rans", "auto",
                       "zstd19", "best", "best_vs_entropy"])
    result = {"throughput": rows, "pieces": pieces, "entropy": ent, "threads": args.threads}
    write_result(result, args.out)
    return result



if __name__ == "__main__":
    from dqsgd.cli.bench.parser import parse_args

    bench_codec(parse_args(["bench", "codec", *sys.argv[1:]]))
