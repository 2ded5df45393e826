"""CPU cost of the coded path against ``qsgd-2bit``'s: encode + decode of one gradient, as ratios.

``python benchmarks/coded_step_cost.py [--numel N] [--bits 2 3 4 6] [--repeats R] [--threads T]``
prints, for a Gaussian gradient of N coordinates (3.2M by default: the 1024×1024 MLP of the network
benchmark), the best milliseconds of

* the reference: ``encode_uniform_fast`` at 2 bits, FIXED, and ``decode_accumulate`` of its payload;
* each width with ``coding`` AUTO and RANSX: the encode, and the decode of a payload whose codes
  :mod:`dqsgd.kernels.recent` does not hold (what a rank pays for another rank's payload; the
  simulation, which decodes in the process that encoded, pays less);

and each one's (encode + decode) / the reference's. All callables are interleaved round by round, so
that a busy machine slows them alike; the figures are ratios in one process, not absolute speeds.
``--clock cpu`` times the process's CPU time instead of the elapsed time (all threads together:
what the codec costs the machine, steadier than elapsed time beside other jobs).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

from dqsgd.codecs import Coding
from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast
from dqsgd.kernels import recent


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def best_ms(fns: dict[str, Callable[[], Any]], repeats: int, clock: Callable[[], float]) -> dict[str, float]:
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = clock()
            f()
            best[k] = min(best[k], clock() - t)
    return {k: 1e3 * v for k, v in best.items()}


def rows(numel: int, widths: list[int], repeats: int,
         clock: Callable[[], float]) -> list[tuple[str, float, float, float]]:
    g = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    rng, out = HashRNG(1, 2, 3), torch.zeros(numel)
    ref = encode_uniform_fast(g, 2, rng)
    fns: dict[str, Callable[[], Any]] = {"enc fixed 2": lambda: encode_uniform_fast(g, 2, rng),
                                         "dec fixed 2": lambda: decode_accumulate(ref, out)}
    sizes = {}
    for b in widths:
        for coding in (Coding.AUTO, Coding.RANSX):
            payload = encode_uniform_fast(g, b, rng, coding=coding)
            sizes[(b, coding)] = (8 * len(payload) / numel, Coding(payload[5]).name)
            fns[f"enc {coding.name} {b}"] = lambda b=b, c=coding: encode_uniform_fast(g, b, rng, coding=c)
            fns[f"dec {coding.name} {b}"] = lambda p=payload: (recent.clear(), decode_accumulate(p, out))
    t = best_ms(fns, repeats, clock)
    base = t["enc fixed 2"] + t["dec fixed 2"]
    table = [("FIXED 2", t["enc fixed 2"], t["dec fixed 2"], 1.0)]
    for b in widths:
        for coding in (Coding.AUTO, Coding.RANSX):
            key = f"{coding.name} {b}"
            bpc, used = sizes[(b, coding)]
            table.append((f"{key} ({used}, {bpc:.2f} b/c)", t[f"enc {key}"], t[f"dec {key}"],
                          (t[f"enc {key}"] + t[f"dec {key}"]) / base))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=3_200_000)
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 6])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2, help="codec threads (torch.set_num_threads)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: elapsed time; cpu: the process's CPU time, all threads (steadier on a busy machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'coding':<34} {'enc ms':>7} {'dec ms':>7} {'ratio':>6}   ((enc + dec) / FIXED 2-bit's, {args.clock} time)")
    for name, enc, dec, ratio in rows(args.numel, args.bits, args.repeats, CLOCKS[args.clock]):
        print(f"{name:<34} {enc:>7.2f} {dec:>7.2f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
