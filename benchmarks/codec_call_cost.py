"""Per-call cost of the CPU codec on DDP-hook-sized shards: the generic calls against a FixedPlan.

``python benchmarks/codec_call_cost.py [--numel N] [--bits B] [--calls K] [--repeats R]`` prints, for
the shards of an N-element bucket at W = 1, 2, 4, 8 (N/W elements each), microseconds per call of

* ``encode_uniform_fast`` (a new ``bytes`` payload) and ``FixedPlan.encode_into`` (into a buffer);
* ``decode_accumulate`` (parses the header) and ``FixedPlan.accumulate`` (compares it);

and the ratio generic / plan. One thread, max norm, one segment per shard (the hook's qsgd setting).
Each figure is the best of ``repeats`` rounds of ``calls`` calls, the four callables interleaved, so
that a busy machine slows them alike. Both paths are checked to give the same bytes and sums first.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np
import torch

from dqsgd.kernels import HashRNG, decode_accumulate, encode_uniform_fast
from dqsgd.kernels.codec import fixed_plan
from dqsgd.quantizers import Layout, Norm


def per_call_us(fns: dict[str, Callable[[], Any]], calls: int, repeats: int) -> dict[str, float]:
    """Best mean microseconds per call of each callable over ``repeats`` interleaved rounds."""
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                f()
            best[k] = min(best[k], (time.perf_counter() - t) / calls * 1e6)
    return best


def shard_row(numel: int, bits: int, calls: int, repeats: int) -> dict[str, float]:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    rng, plan = HashRNG(1, 2, 3), fixed_plan(numel, bits, Norm.MAX, Layout())
    buf = np.empty(plan.size, dtype=np.uint8)
    payload = encode_uniform_fast(x, bits, rng)
    plan.encode_into(x, rng, buf)
    a, b = torch.zeros(numel), torch.zeros(numel)
    decode_accumulate(payload, a)
    plan.accumulate(buf, b)
    if buf.tobytes() != payload or not torch.equal(a, b):
        raise AssertionError(f"the plan's payload or sum differs at numel={numel}")
    return per_call_us({
        "encode_uniform_fast": lambda: encode_uniform_fast(x, bits, rng),
        "plan.encode_into": lambda: plan.encode_into(x, rng, buf),
        "decode_accumulate": lambda: decode_accumulate(payload, a),
        "plan.accumulate": lambda: plan.accumulate(buf, b),
    }, calls, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=199_210, help="bucket elements (default: the 784-200-200-10 MLP)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'W':>2} {'numel':>7} | {'encode_fast':>11} {'plan.enc':>9} {'ratio':>5} | "
          f"{'decode_acc':>10} {'plan.acc':>9} {'ratio':>5}   (us per call)")
    for world in (1, 2, 4, 8):
        n = -(-args.numel // world)
        r = shard_row(n, args.bits, args.calls, args.repeats)
        enc, penc, dec, pdec = (r[k] for k in ("encode_uniform_fast", "plan.encode_into", "decode_accumulate",
                                               "plan.accumulate"))
        print(f"{world:>2} {n:>7} | {enc:>11.1f} {penc:>9.1f} {enc / penc:>5.2f} | {dec:>10.1f} {pdec:>9.1f} "
              f"{dec / pdec:>5.2f}")


if __name__ == "__main__":
    main()
