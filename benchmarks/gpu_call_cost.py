"""Where one GPU codec call's time goes: host (Python + launches) against device (kernels), per size.

    PYTHONPATH=src python3 benchmarks/gpu_call_cost.py --out DIR      # needs a CUDA GPU; writes call_cost.md
    PYTHONPATH=src python3 benchmarks/gpu_call_cost.py --count        # no GPU needed: launches and ops per pair
    PYTHONPATH=src python3 benchmarks/gpu_call_cost.py --bucket --sizes 25000000 --out DIR  # each leg of one
        # bucket's codec calls on one rank (W = 4, 8) against copy_: bucket_cost.md

For n in --sizes, the hook's no-sync pair (``encode_uniform_device(check="defer")`` then
``decode_accumulate_device(header=..., check="defer")``) at 4 bits:

* ``host_us``: wall time of the Python calls alone, no synchronize (what the CPU spends issuing them),
  median of 50 calls after 10 warm-ups;
* ``wall_us``: the same with a synchronize after each pair (what one pair costs end to end);
* ``kernels`` and ``kernel_us``: device kernels launched per pair and their summed device time
  (torch.profiler, CUDA activity), and the other torch ops' count (``ops``);
* ``copy_us``: ``copy_`` of the same float32 tensor, the memory-bound reference.
If host_us ≈ wall_us ≫ kernel_us, the call is bound by issuing work, not by the GPU.

``--count`` runs the same pair on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``,
``set_triton(True)``: the code path a GPU runs) and counts, per pair, the Triton kernel launches, the
aten ops (every ``aten::`` call the profiler records, nested ones included, as on the GPU) and the
aten ops that would launch a device kernel (innermost ones that are not views or allocations): what
the host issues, whatever the device. Times are not measured there (the interpreter is not a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

# aten ops that launch no device kernel: views, shape metadata and allocations
_NO_KERNEL = re.compile(r"aten::(_?(empty|view|reshape|as_strided|slice|select|alias|detach|unsqueeze|squeeze|"
                        r"expand|t|permute|unbind|split|narrow|lift_fresh|resolve_conj|resolve_neg|_unsafe_view|"
                        r"_reshape_alias|view_as|result_type|size|stride|is_nonzero|contiguous|to|_to_copy_meta|"
                        r"empty_like|empty_strided|set_|item|_local_scalar_dense|index_select_meta)|.*_meta)$")

_LAUNCH = "triton launch"


@contextlib.contextmanager
def _counting(launches: dict[str, int]):
    """Count every Triton launch by kernel name into ``launches`` and mark it for the profiler (the
    interpreter's own torch ops inside a launch are not the host's)."""
    from torch.profiler import record_function
    from triton.runtime.jit import KernelInterface

    original = KernelInterface.__getitem__

    def counting(self, grid):  # noqa: ANN001, ANN202 - Triton's own signature
        name = getattr(getattr(self, "fn", self), "__name__", "kernel")
        launches[name] = launches.get(name, 0) + 1
        launch = original(self, grid)

        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the interpreter's own torch ops are not counted
            with record_function(_LAUNCH):
                return launch(*args, **kwargs)
        return run

    KernelInterface.__getitem__ = counting
    try:
        yield
    finally:
        KernelInterface.__getitem__ = original


def count_pair(n: int, bits: int = 4, repeat: int = 2) -> dict:
    """Triton launches, aten ops and kernel-launching aten ops per no-sync pair, on CPU tensors through
    Triton's interpreter (needs ``TRITON_INTERPRET=1`` before Triton is first imported)."""
    from torch.profiler import ProfilerActivity, profile

    from dqsgd.kernels import HashRNG, device_common
    from dqsgd.kernels.device import decode_accumulate_device, encode_uniform_device, expected_header

    x, out = torch.randn(n, generator=torch.Generator().manual_seed(0)), torch.zeros(n)
    rng, hdr, bad = HashRNG(3, 1, 0), expected_header((n,), bits), torch.zeros((), dtype=torch.bool)
    launches: dict[str, int] = {}
    device_common.set_triton(True)
    try:
        p = encode_uniform_device(x, bits, rng, check="defer")  # warm: templates, tables, caches
        decode_accumulate_device(p, out, header=hdr, check="defer", bad=bad)
        with _counting(launches), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeat):
                p = encode_uniform_device(x, bits, rng, check="defer")
                decode_accumulate_device(p, out, header=hdr, check="defer", bad=bad)
    finally:
        device_common.set_triton(None)
    return {"n": n, "bits": bits, **_tally(prof.events(), launches, repeat)}


def bucket_legs(n: int, workers: int, bits: int = 4, dbits: int = 8, device: str = "cpu"):
    """(uplink, downlink, bad): the two legs of one sharded bucket's codec calls on one rank, the ones
    the hook and the trainer make (device path, no sync), as callables: the uplink encodes the rank's W
    shard payloads into one buffer and decodes and averages the W payloads of its shard; the downlink
    encodes its shard's downlink and decodes the W shards' downlink payloads. The payloads the other
    ranks would send are made beforehand (this rank's, the same sizes): what is measured is the calls.
    The outputs are written, not read (``fresh``), as the exchange's are; the calls take their scratch
    buffers from one workspace kept across calls, as the exchange does (:mod:`dqsgd.kernels.workspace`).
    On CPU tensors the Triton kernels run under the interpreter (``TRITON_INTERPRET=1`` before Triton is
    first imported); the caller turns the device path on (``set_triton(True)``,
    ``payloads.route_cpu_through_device_codec(True)``)."""
    from dqsgd.kernels import HashRNG, workspace
    from dqsgd.method.config import method_config
    from dqsgd.topology import payloads
    from dqsgd.topology.bucket import BucketProtocol

    proto = BucketProtocol(method_config("qsgd", bits=bits), n, [n], topology="sharded", workers=workers, seed=0,
                           total_steps=10, downlink_bits=dbits)
    flat = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    bad = torch.zeros((), dtype=torch.bool, device=device)
    size = max(proto.down_sizes()) + 1
    rngs = [HashRNG(1, 1, j) for j in range(workers)]
    send, at, sizes = payloads.encode_batched(proto.shards, proto.bounds, flat, bits, rngs, gap=1)
    recv = torch.cat([send[at[0] : at[0] + sizes[0] + 1]] * workers)  # what the all-to-all delivers for shard 0
    received = [recv[w * (sizes[0] + 1) : w * (sizes[0] + 1) + sizes[0]] for w in range(workers)]
    gathered = [proto.encode_down(j, flat[lo:hi].contiguous(), 1, size) for j, (lo, hi) in enumerate(proto.bounds)]
    m0 = proto.shards[0].numel
    ws: dict = {}  # the rank's workspace for the bucket, as the exchange keeps it (Memory.workspace)
    avg = [flat[:m0].contiguous()]

    def up() -> None:
        with workspace.use(ws):
            payloads.encode_batched(proto.shards, proto.bounds, flat, bits, rngs, gap=1)
            avg[0] = proto.reduce(0, received, bits, out=torch.empty(m0, device=device), bad=bad)

    def down() -> None:
        with workspace.use(ws):
            proto.encode_down(0, avg[0], 1, size)
            proto.decode_down(gathered, workspace.scratch("update", n, torch.float32, flat.device), bad)

    return up, down, bad


@contextlib.contextmanager
def _device_path():
    from dqsgd.kernels import device_common
    from dqsgd.topology import payloads

    device_common.set_triton(True)
    payloads.route_cpu_through_device_codec(True)
    try:
        yield
    finally:
        payloads.route_cpu_through_device_codec(False)
        device_common.set_triton(None)


def count_bucket(n: int, workers: int, bits: int = 4, dbits: int = 8, repeat: int = 2) -> dict:
    """Triton launches and aten ops of one sharded bucket's codec calls on one rank (:func:`bucket_legs`,
    both legs), on CPU tensors through Triton's interpreter."""
    from torch.profiler import ProfilerActivity, profile

    launches: dict[str, int] = {}
    with _device_path():
        up, down, bad = bucket_legs(n, workers, bits, dbits)
        up(), down()  # warm: plans, templates, tables
        with _counting(launches), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeat):
                up(), down()
    return {"n": n, "workers": workers, "bits": bits, "bad": bool(bad), **_tally(prof.events(), launches, repeat)}


def measure_bucket(n: int, workers: int, bits: int = 4, dbits: int = 8, rounds: int = 20) -> dict:
    """Each leg of one bucket's codec calls on one rank (:func:`bucket_legs`) and both as a ratio to
    ``copy_`` of the bucket's n float32 (1 = as fast as copy_): median over interleaved rounds, a
    synchronize around each call (``dqsgd bench gpu``'s own timing of its codec rows). On the CPU (no
    GPU) a smoke run through the interpreter, not figures."""
    from dqsgd.cli.bench.gpu import _ratios

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with _device_path():
        up, down, bad = bucket_legs(n, workers, bits, dbits, dev)
        x, buf = torch.randn(n, device=dev), torch.empty(n, device=dev)
        fns = {"copy": lambda: buf.copy_(x), "enc": up, "dec": down, "both": lambda: (up(), down())}
        row = _ratios(fns, torch.cuda.synchronize if dev == "cuda" else (lambda: None), rounds)
    return {"n": n, "workers": workers, "bits": bits, "dbits": dbits, "bad": bool(bad),
            "up": row["enc"], "down": row["dec"], "both": row["both"], "copy_us": 1e3 * row["copy_ms"],
            **{f"{k}_us": 1e3 * row[f"{e}_ms"] for k, e in (("up", "enc"), ("down", "dec"), ("both", "both"))}}


def _tally(events: list, launches: dict[str, int], repeat: int) -> dict:
    """Per-pair counts from the profiler's events: aten calls outside the Triton launches, the
    innermost ones that launch a device kernel, and the launches by kernel."""
    inside = set()
    for e in events:
        if e.name == _LAUNCH:
            stack = list(e.cpu_children)
            while stack:
                c = stack.pop()
                inside.add(id(c))
                stack.extend(c.cpu_children)
    aten = [e for e in events if e.name.startswith("aten::") and id(e) not in inside]
    leaf = [e for e in aten if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    kernels = [e.name for e in leaf if not _NO_KERNEL.match(e.name)]
    return {"triton": sum(launches.values()) / repeat, "aten_ops": len(aten) / repeat,
            "aten_kernels": len(kernels) / repeat, "by_kernel": {k: v / repeat for k, v in sorted(launches.items())},
            "by_op": {k: kernels.count(k) / repeat for k in sorted(set(kernels))}}


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
    ap.add_argument("--out", help="folder for call_cost.md (the GPU timing run; required without --count)")
    ap.add_argument("--sizes", default="1000,1000000,25000000")
    ap.add_argument("--count", action="store_true", help="count launches and ops per pair on the CPU (interpreter)")
    ap.add_argument("--bucket", action="store_true", help="time each leg of one sharded bucket's codec calls on one "
                    "rank against copy_ (bucket_cost.md); without a GPU a smoke run through the interpreter")
    ap.add_argument("--workers", default="4,8", help="W for --bucket")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds for --bucket")
    a = ap.parse_args()
    if a.bucket:
        rows = [measure_bucket(int(s), int(w), rounds=a.rounds) for s in a.sizes.split(",")
                for w in a.workers.split(",")]
        where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke run, not GPU figures)"
        lines = [f"# One bucket's codec legs on one rank against copy_, on {where} (torch {torch.__version__})", "",
                 "| n | W | bits | down bits | uplink (enc + decode-average) | downlink (enc + decode) | both | "
                 "up_us | down_us | copy_us | bad |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['n']} | {r['workers']} | {r['bits']} | {r['dbits']} | {r['up']:.3f} | {r['down']:.3f} | "
                  f"{r['both']:.3f} | {r['up_us']:.0f} | {r['down_us']:.0f} | {r['copy_us']:.0f} | {r['bad']} |"
                  for r in rows]
        lines += ["", "Legs as t(copy_ of the bucket's n float32) / t(leg), median of interleaved rounds "
                  "(docs/gpu-codec.md, \"Passes and their bound\", gives each leg's byte bound)."]
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            (Path(a.out) / "bucket_cost.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    if a.count:
        for s in a.sizes.split(","):
            c = count_pair(int(s))
            print(f"n={c['n']} bits={c['bits']}: triton launches {c['triton']:.0f}, kernel-launching aten ops "
                  f"{c['aten_kernels']:.0f} (device kernels {c['triton'] + c['aten_kernels']:.0f}), aten ops "
                  f"{c['aten_ops']:.0f}\n  triton: {c['by_kernel']}\n  aten: {c['by_op']}")
        return
    if not a.out:
        ap.error("--out is required (or --count)")
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
    if "--count" in sys.argv or ("--bucket" in sys.argv and not torch.cuda.is_available()):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
    main()
