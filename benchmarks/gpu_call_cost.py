"""Where one GPU codec call's time goes: host (Python + launches) against device (kernels), per size.

    PYTHONPATH=src python3 benchmarks/gpu_call_cost.py --out DIR      # needs a CUDA GPU; writes call_cost.md

For n in --sizes, the hook's no-sync pair (``encode_uniform_device(check="defer")`` then
``decode_accumulate_device(header=..., check="defer")``) at 4 bits:

* ``host_us``: wall time of the Python calls alone, no synchronize (what the CPU spends issuing them),
  median of 50 calls after 10 warm-ups;
* ``wall_us``: the same with a synchronize after each pair (what one pair costs end to end);
* ``kernels`` and ``kernel_us``: device kernels launched per pair and their summed device time
  (torch.profiler, CUDA activity), and the other torch ops' count (``ops``);
* ``copy_us``: ``copy_`` of the same float32 tensor, the memory-bound reference.
If host_us ≈ wall_us ≫ kernel_us, the call is bound by issuing work, not by the GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def measure(n: int, bits: int = 4) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from dqsgd.kernels import HashRNG
    from dqsgd.kernels.device import decode_accumulate_device, encode_uniform_device, expected_header

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke run, not GPU figures
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x, out, buf = torch.randn(n, device=dev), torch.zeros(n, device=dev), torch.empty(n, device=dev)
    rng, hdr = HashRNG(3, 1, 0), expected_header((n,), bits)
    bad = torch.zeros((), dtype=torch.bool, device=dev)

    def pair() -> None:
        p = encode_uniform_device(x, bits, rng, check="defer")
        decode_accumulate_device(p, out, header=hdr, check="defer", bad=bad)

    for _ in range(10):
        pair()
    sync()
    host, wall, copy = [], [], []
    for _ in range(50):
        t = time.perf_counter()
        pair()
        host.append(time.perf_counter() - t)
        sync()
        wall.append(time.perf_counter() - t)
        t = time.perf_counter()
        buf.copy_(x)
        sync()
        copy.append(time.perf_counter() - t)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            pair()
        sync()
    events = prof.key_averages()
    kern = [e for e in events if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
    k_count = sum(e.count for e in kern) / 5
    k_us = sum(e.self_device_time_total for e in kern) / 5
    ops = sum(e.count for e in events if e.key.startswith("aten::")) / 5
    top = sorted(kern, key=lambda e: -e.count)[:8]
    return {"n": n, "bits": bits, "host_us": 1e6 * statistics.median(host), "wall_us": 1e6 * statistics.median(wall),
            "kernels": k_count, "kernel_us": k_us, "ops": ops, "copy_us": 1e6 * statistics.median(copy),
            "top": [(e.key[:60], e.count // 5) for e in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="1000,1000000,25000000")
    a = ap.parse_args()
    rows = [measure(int(s)) for s in a.sizes.split(",")]
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke run, not GPU figures)"
    lines = [f"# GPU codec call cost on {where} (torch {torch.__version__})", "",
             "| n | bits | host_us | wall_us | kernels | kernel_us | aten ops | copy_us |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['n']} | {r['bits']} | {r['host_us']:.0f} | {r['wall_us']:.0f} | {r['kernels']:.1f} | "
              f"{r['kernel_us']:.0f} | {r['ops']:.0f} | {r['copy_us']:.0f} |" for r in rows]
    lines += ["", "Most launched kernels per pair (name, count):", ""]
    lines += [f"- n = {r['n']}: " + ", ".join(f"`{k}` ×{c}" for k, c in r["top"]) for r in rows]
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "call_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
