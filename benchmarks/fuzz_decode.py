"""Long-running fuzzer for the payload decoder (the suite runs a bounded Hypothesis version).

    python benchmarks/fuzz_decode.py --seconds 300 [--seed 1]

Mutates valid payloads of every scheme and coding (bit flips, byte overwrites, truncation, padding,
splices, random bytes; half of the time with the CRC recomputed so mutations reach the deeper checks)
and checks that ``decode`` either raises ``PayloadError`` or returns a ``Quantized`` whose re-encoding
decodes to the same values. Any other exception, or a decode that allocates from a forged size, is a
failure (exit code 1). Prints how many cases ran and how they ended.
"""

from __future__ import annotations

import argparse
import random
import struct
import sys
import time
import tracemalloc
import zlib
from collections import Counter

import torch

from dqsgd.codecs import Coding, PayloadError, decode, encode
from dqsgd.quantizers import Layout, dequantize, quantize_identity, quantize_lowprec, quantize_sign, quantize_ternary, quantize_uniform


def seeds(rng: random.Random) -> list[bytes]:
    out = []
    for n in [0, 1, 7, 100, 1000]:
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        qs = [quantize_uniform(x, b, gen, layout=Layout(bucket=rng.choice([0, 3, 64]))) for b in (2, 4, 8, 16)]
        qs += [quantize_sign(x, scaled=True), quantize_ternary(x, gen), quantize_lowprec(x, 5, gen), quantize_identity(x)]
        for q in qs:
            for coding in (Coding.FIXED, Coding.ELIAS, Coding.ZSTD, Coding.ZSTD_ALIGNED, Coding.RANS, Coding.RANSX,
                           Coding.AUTO):
                try:
                    out.append(encode(q, coding))
                except ValueError:
                    pass  # e.g. identity with Elias or rANS: not a valid combination
    return out


def mutate(p: bytes, rng: random.Random) -> bytes:
    b = bytearray(p)
    op = rng.randrange(6)
    if op == 0 and b:
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b) * 8)
            b[i // 8] ^= 1 << (i % 8)
    elif op == 1 and b:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 2:
        b = b[: rng.randrange(len(b) + 1)]
    elif op == 3:
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif op == 4 and len(b) > 16:  # forge a 32-bit field somewhere in the header with a huge value
        i = rng.randrange(8, min(len(b) - 4, 40))
        b[i : i + 4] = struct.pack("<I", rng.choice([0xFFFFFFFF, 1 << 28, 1 << 31, rng.randrange(1 << 32)]))
    else:
        b = bytearray(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    if rng.random() < 0.5 and len(b) >= 4:  # fix the CRC so the mutation reaches the structural checks
        b[-4:] = struct.pack("<I", zlib.crc32(bytes(b[:-4])) & 0xFFFFFFFF)
    return bytes(b)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    corpus = seeds(rng)
    outcomes: Counter[str] = Counter()
    tracemalloc.start()
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        p = mutate(rng.choice(corpus), rng)
        tracemalloc.reset_peak()
        try:
            q = decode(p, max_numel=1 << 20)
            again = dequantize(decode(encode(q, Coding.FIXED if q.bits <= 16 or q.values is not None else Coding.FIXED)))
            if not torch.equal(again, dequantize(q)):
                print(f"FAIL: re-encode changed the values for payload {p.hex()}")
                return 1
            outcomes["decoded (valid after mutation)"] += 1
        except PayloadError:
            outcomes["PayloadError"] += 1
        except Exception as e:  # anything else is a bug
            print(f"FAIL: {type(e).__name__}: {e}\npayload {p.hex()}")
            return 1
        if tracemalloc.get_traced_memory()[1] > 64 << 20:
            print(f"FAIL: decoding a {len(p)}-byte payload allocated over 64 MiB")
            return 1
    total = sum(outcomes.values())
    print(f"fuzzed {total} payloads in {args.seconds:.0f} s: " + ", ".join(f"{k} {v}" for k, v in outcomes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
