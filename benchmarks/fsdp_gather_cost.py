"""CPU cost of FSDP's quantized parameter all-gather (``dqsgd.fsdp.gather``): its codec, and one whole call.

    python benchmarks/fsdp_gather_cost.py [--numel 262400] [--bits 8,4] [--block 2048] [--calls 20] [--repeats 5]
                                          [--world 4]

1. The codec on one shard of ``numel`` float32 parameters (the 3.1M MLP's unit at W = 4: 262,400),
   on one thread: the rank's encode and one decode, by the torch-ops path the all-gather used before
   (``encode(quantize_uniform(...), FIXED)``; ``decode`` + ``dequantize`` + a finite check) and by
   today's ``encode_shard`` / ``decode_shard`` (the fused kernels), in milliseconds per call and as a
   ratio to ``copy_`` of the same float32 shard timed in the same rounds. Both paths are checked to
   give the same payload bytes and the same decoded floats first.
2. With ``--world W`` > 1: one unit's whole all-gather call (``DQSGDAllGather.__call__``) on W gloo
   ranks over loopback, one thread each, split into its phases (encode; the one all-gather of the
   frames; the W checks and decodes; the rest: framing, the final write and bookkeeping), against
   ``dist.all_gather_into_tensor`` of the float32 shards (FSDP's own all-gather) in the same rounds.
   Rank 0's best round; on a machine with fewer cores than ranks the ranks wait for each other's CPU.
   ``cpu``: the CPU seconds rank 0's process spent per call (its gloo threads included).

Figures are the best of ``repeats`` interleaved rounds of ``calls`` calls, so that a busy machine
slows every column alike.
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any, Callable

import torch


def per_call_ms(fns: dict[str, Callable[[], Any]], calls: int, repeats: int) -> dict[str, float]:
    """Best mean milliseconds per call of each callable over ``repeats`` interleaved rounds."""
    from codec_call_cost import per_call_us  # benchmarks/ is the script's directory

    return {k: v / 1e3 for k, v in per_call_us(fns, calls, repeats).items()}


def torch_ops_encode(x: torch.Tensor, bits: int, block: int) -> bytes:
    """The all-gather's encode before the fused kernel: round-to-nearest through quantize_uniform."""
    from dqsgd.codecs import Coding, encode
    from dqsgd.quantizers import Layout, quantize_uniform

    class Nearest:
        def uniform(self, n: int, device: Any = None) -> torch.Tensor:
            return torch.full((n,), 0.5, dtype=torch.float32, device=device)

    return encode(quantize_uniform(x, bits, layout=Layout(bucket=block), rng=Nearest()), Coding.FIXED)


def torch_ops_decode(p: bytes, n: int) -> torch.Tensor:
    """The all-gather's decode before: ``decode``, ``dequantize`` and a finite check."""
    from dqsgd.codecs import decode
    from dqsgd.quantizers import dequantize

    v = dequantize(decode(p, max_numel=n)).reshape(-1).to(torch.float32)
    assert bool(torch.isfinite(v).all())
    return v


def codec_rows(numel: int, bits_list: list[int], block: int, calls: int, repeats: int) -> None:
    from dqsgd.fsdp.gather import decode_shard, encode_shard

    torch.set_num_threads(1)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 0.02
    dst = torch.empty(numel)
    print(f"codec, one shard of {numel:,} float32 ({4 * numel / 2**20:.2f} MiB), blocks of {block}, one thread:")
    print(f"{'bits':>4} {'step':<7} {'before ms':>9} {'now ms':>7} {'copy_ ms':>8} {'before/copy':>11} "
          f"{'now/copy':>8} {'speed-up':>8}")
    for bits in bits_list:
        p = encode_shard(x, bits, "nearest", block, 0)
        assert p == torch_ops_encode(x, bits, block), "the fused payload differs from the torch-ops one"
        out = torch.zeros(numel)
        assert torch.equal(decode_shard(p, numel, bits, block, out), torch_ops_decode(p, numel))
        t = per_call_ms({"copy": lambda: dst.copy_(x),
                         "enc_old": lambda: torch_ops_encode(x, bits, block),
                         "enc_new": lambda: encode_shard(x, bits, "nearest", block, 0),
                         "dec_old": lambda: torch_ops_decode(p, numel),
                         "dec_new": lambda: decode_shard(p, numel, bits, block, out.zero_())}, calls, repeats)
        for step in ("enc", "dec"):
            old, new, c = t[f"{step}_old"], t[f"{step}_new"], t["copy"]
            print(f"{bits:>4} {'encode' if step == 'enc' else 'decode':<7} {old:9.3f} {new:7.3f} {c:8.3f} "
                  f"{old / c:10.0f}x {new / c:7.1f}x {old / new:7.1f}x")


PHASES = ("encode", "exchange", "decode")


def rank_call(rank: int, world: int, numel: int, bits: int, block: int, calls: int, repeats: int) -> dict[str, float]:
    import torch.distributed as dist

    import dqsgd.fsdp as dfsdp
    import dqsgd.fsdp.gather as gather

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "`torch.distributed.all_gather_into_tensor` is deprecated")
    state = dfsdp.FSDPState("sgd", param_bits=bits, param_block=block, timeout=120)
    ag = gather.DQSGDAllGather(state, 0)
    group = dist.group.WORLD
    spent = dict.fromkeys(PHASES, 0.0)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t
        return call

    g = gather.exchange_group(group, state.timeout)
    g.wait = timed("exchange", g.wait)  # type: ignore[method-assign]
    gather.encode_shard = timed("encode", gather.encode_shard)
    gather.opened = timed("decode", gather.opened)
    out = torch.empty(world * numel)
    chunk = out[rank * numel:(rank + 1) * numel]
    chunk.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 0.02)
    ref_out = torch.empty(world * numel)
    best: dict[str, float] = {}
    for r in range(repeats + 1):  # round 0 warms up (kernels, process groups)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(calls):
            dist.all_gather_into_tensor(ref_out, chunk)
        fp32 = (time.perf_counter() - t) / calls
        dist.barrier()
        for k in spent:
            spent[k] = 0.0
        t, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            ag(out, chunk, group)
        total, cpu = (time.perf_counter() - t) / calls, (time.process_time() - cpu) / calls
        row = {"fp32 all-gather": fp32, "dqsgd call": total, **{k: v / calls for k, v in spent.items()}, "cpu": cpu}
        row["rest"] = total - sum(row[k] for k in PHASES)
        if r and (not best or row["dqsgd call"] < best["dqsgd call"]):
            best = row
    return {k: v * 1e3 for k, v in best.items()}


def call_rows(world: int, numel: int, bits_list: list[int], block: int, calls: int, repeats: int) -> None:
    from dqsgd.cli.launch import spawn_local

    print(f"\nwhole all-gather call, W = {world} gloo ranks on loopback, one thread each, rank 0's ms per call:")
    cols = ("fp32 all-gather", "dqsgd call", *PHASES, "rest", "cpu")
    print(f"{'bits':>4} " + " ".join(f"{c:>15}" for c in cols))
    for bits in bits_list:
        res = spawn_local(rank_call, world, (numel, bits, block, calls, repeats), timeout=120, deadline=600)
        assert all(r.ok for r in res), [r.describe() for r in res]
        row = res[0].value
        print(f"{bits:>4} " + " ".join(f"{row[c]:15.3f}" for c in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=262400)
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--block", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--world", type=int, default=0, help="ranks for the whole-call rows (0: codec only)")
    a = ap.parse_args()
    bits = [int(b) for b in a.bits.split(",")]
    codec_rows(a.numel, bits, a.block, a.calls, a.repeats)
    if a.world > 1:
        call_rows(a.world, a.numel, bits, a.block, a.calls, a.repeats)


if __name__ == "__main__":
    main()
