"""``dqsgd bench fsdp`` and the FSDP training example: gloo processes on 127.0.0.1, ``fully_shard`` per block.

Both run an MLP whose every ``Linear`` is its own FSDP unit, once with FSDP's own reduce-scatter
(fp32, or bf16 through ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``) and once per dqsgd
method. Bytes are what each rank hands to the process group for gradients per step: FSDP's own
reduce-scatter sends (W−1)/W of its input; dqsgd's are counted by :class:`~dqsgd.fsdp.FSDPState`
(payloads, size exchange, policy statistics, exact warm-up calls).

With ``--rates`` (root, a source checkout) the W ranks run in network namespaces joined by a bridge
whose links are shaped with tc/tbf to each rate (``benchmarks/network/netns.py``, as ``dqsgd bench
network``), so the step time includes the real cost of moving FSDP's bytes — the exact parameter
all-gathers of forward and backward as well as the gradient reduce-scatter — and each rank's wire
bytes are read from its interface.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

DEFAULTS = ("fsdp fp32", "fsdp bf16")


def mlp(sizes: list[int], world: int, variant: str, total_steps: int, seed: int) -> tuple[nn.Module, Any]:
    """An MLP of ``sizes`` with each Linear (and the root) fully_shard-ed on a 1-D CPU mesh; ``variant``:
    ``"fsdp fp32"``, ``"fsdp bf16"`` (reduce dtype) or a dqsgd method name. Returns (model, FSDPState or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dqsgd.fsdp import FSDPState, compress

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if variant == "fsdp bf16" else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if variant in DEFAULTS:
        return model, None
    state = FSDPState(variant, seed=seed, total_steps=total_steps, timeout=120)
    compress(model, state)
    return model, state


def gradient_bytes(model: nn.Module, variant: str, state: Any, world: int) -> int:
    """Bytes this rank has handed to the group for gradients so far (per step for FSDP's own: computed)."""
    if state is not None:
        return state.compression_stats().bytes_sent
    itemsize = 2 if variant == "fsdp bf16" else 4
    padded = sum(-(-p.shape[0] // world) * world * p[0].numel() if p.dim() > 1 else -(-p.shape[0] // world) * world
                 for p in model.parameters())
    return (world - 1) * padded * itemsize // world


def _bench_rank(rank: int, world: int, args: argparse.Namespace,
                wire: Callable[[], int] | None = None) -> dict[str, Any]:
    """Every variant's median step time, gradient bytes per step and time inside dqsgd's calls (and,
    given ``wire``, the bytes this rank's interface sent per timed step)."""
    sizes = [int(s) for s in args.sizes.split(",")]
    out: dict[str, Any] = {}
    for variant in [*DEFAULTS, *args.methods.split(",")]:
        model, state = mlp(sizes, world, variant, args.warmup + args.steps, 0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        times = []
        for s in range(args.warmup + args.steps):
            x = torch.randn(args.batch, sizes[0], generator=gen)
            t0 = time.perf_counter()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if s >= args.warmup:
                times.append(time.perf_counter() - t0)
            if s == args.warmup - 1:
                before = gradient_bytes(model, variant, state, world)
                rs_before = state.seconds if state is not None else 0.0
                tx = wire() if wire is not None else 0
        total = gradient_bytes(model, variant, state, world)
        per_step = total if state is None else (total - before) / args.steps
        rs_ms = 1000 * (state.seconds - rs_before) / args.steps if state is not None else float("nan")
        out[variant] = {"ms": 1000 * statistics.median(times), "bytes": per_step, "rs_ms": rs_ms}
        if wire is not None:
            out[variant]["wire"] = (wire() - tx) / args.steps
    return out


def bench_fsdp(args: argparse.Namespace, netns: Any = None) -> None:
    """Print (and save) gradient bytes per rank per step and step time per variant, W gloo ranks
    on loopback, or with ``args.rates`` on shaped links (``netns``: the checkout's
    ``benchmarks/network/netns.py``)."""
    from dqsgd.cli.launch import spawn_local

    if args.warmup < 1:
        raise ValueError("--warmup must be at least 1 (the bytes are counted after it)")
    plain = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})  # picklable for the ranks
    if getattr(args, "rates", ""):
        bench_shaped(plain, netns)
        return
    results = spawn_local(_bench_rank, args.world, (plain,), timeout=args.timeout, threads=args.threads,
                          deadline=args.deadline)
    if not all(r.ok for r in results):
        raise RuntimeError("; ".join(r.describe() for r in results if not r.ok))
    print(f"FSDP2 gradient reduce-scatter, W = {args.world} gloo ranks (CPU), MLP {args.sizes}, batch {args.batch}/rank, "
          f"median of {args.steps} steps after {args.warmup}")
    print(table([r.value for r in results]))
    if args.out:
        save(args.out, {"args": vars(plain), "ranks": [r.value for r in results]})


def table(ranks: list[dict[str, Any]]) -> str:
    """One row per variant: the busiest rank's gradient bytes per step, rank 0's median step time."""
    rows, ref = ranks[0], ranks[0]["fsdp fp32"]
    fp32 = max(r["fsdp fp32"]["bytes"] for r in ranks)
    lines = [f"{'variant':<14} {'grad bytes/rank/step':>21} {'vs fp32':>8} {'ms/step':>9} {'vs fp32':>8} "
             f"{'ms in dqsgd RS':>15}"]
    for name, r in rows.items():
        busiest = max(rank[name]["bytes"] for rank in ranks)
        lines.append(f"{name:<14} {busiest:>21,.0f} {fp32 / busiest:>7.2f}x {r['ms']:>9.1f} "
                     f"{ref['ms'] / r['ms']:>7.2f}x {r['rs_ms']:>15.1f}")
    return "\n".join(lines)


def save(path: str, record: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1, default=str))
    print(f"\nwrote {path}")


# --- on shaped links (network namespaces) -----------------------------------------------------------
def bench_shaped(args: argparse.Namespace, netns: Any) -> None:
    """Every rate of ``args.rates`` × ``args.repeats``: W ranks, each in its own namespace (``netns``:
    the checkout's ``benchmarks/network/netns.py``) on a link shaped to the rate, run
    :func:`_bench_rank`; then the table (:func:`shaped_table`)."""
    import tempfile

    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for rate in rates:
        netns.rate_bits(rate)  # refused before any namespace is made
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    try:
        net = netns.PrivateNetwork(args.world)
    except netns.NetworkUnavailable as e:
        print(f"dqsgd bench fsdp --rates: skipped: {e}")
        return
    import dqsgd

    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": str(args.threads),
           "TORCH_CPP_LOG_LEVEL": "ERROR",  # the namespaces have no name service; c10d says so on every connect
           "PYTHONPATH": os.pathsep.join([str(Path(dqsgd.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    runs: list[dict[str, Any]] = []
    with net, tempfile.TemporaryDirectory(prefix="dqsgd-fsdp-") as tmp:
        Path(tmp, "args.json").write_text(json.dumps(vars(args)))
        for rate in rates:
            net.shape(rate)
            for rep in range(args.repeats):
                result = Path(tmp, f"{rate}-{rep}")
                netns.run_ranks(net, lambda r: [sys.executable, "-c", RANK_MAIN, str(Path(tmp, "args.json")), str(r),
                                                net.address(0), str(result)], env, args.deadline, f"bench fsdp at {rate}")
                ranks = [json.loads(Path(f"{result}.{r}").read_text()) for r in range(args.world)]
                runs.append({"rate": rate, "repeat": rep, "ranks": ranks})
                print(f"{rate} #{rep}: " + ", ".join(f"{v} {ranks[0][v]['ms']:.0f} ms/step" for v in ranks[0]), flush=True)
    print(f"\nFSDP2 on shaped links, W = {args.world} gloo ranks (CPU), MLP {args.sizes}, batch {args.batch}/rank, "
          f"median of {args.steps} steps after {args.warmup}, {args.repeats} repeat(s)")
    print(shaped_table(runs))
    if args.out:
        save(args.out, {"args": vars(args), "runs": runs})


# What a rank process runs (``python -c``): the wire counter is the checkout's netns.tx_bytes.
RANK_MAIN = ("import sys; from dqsgd.cli.bench.parser import load_script; "
             "from dqsgd.cli.bench.fsdp import rank_main; "
             "rank_main(sys.argv[1:], load_script('network/netns.py').tx_bytes)")


def rank_main(argv: list[str], wire: Callable[[], int]) -> None:
    """One rank inside its namespace: ``ARGS.json RANK MASTER RESULT`` (writes ``RESULT.<rank>``);
    ``wire()``: the bytes the namespace's interface has sent."""
    import datetime

    import torch.distributed as dist

    path, rank, master, result = argv
    args = argparse.Namespace(**json.loads(Path(path).read_text()))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:29500", rank=int(rank), world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        out = _bench_rank(int(rank), args.world, args, wire)
        Path(f"{result}.{rank}").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def shaped_table(runs: list[dict[str, Any]]) -> str:
    """Per rate and variant: gradient bytes and wire bytes per step (busiest rank), the step time
    (rank 0's median; the median over repeats and their range) and the speed-up over FSDP fp32."""
    lines = [f"{'rate':>8} {'variant':<11} {'grad B/rank/step':>17} {'vs fp32':>8} {'wire MB/rank/step':>18} "
             f"{'ms/step [range]':>22} {'speed-up':>9}"]
    for rate in dict.fromkeys(r["rate"] for r in runs):
        mine = [r["ranks"] for r in runs if r["rate"] == rate]
        ms = {v: [ranks[0][v]["ms"] for ranks in mine] for v in mine[0][0]}
        fp32 = max(rank["fsdp fp32"]["bytes"] for rank in mine[0])
        for v, times in ms.items():
            grad = max(rank[v]["bytes"] for rank in mine[0])
            wire = statistics.median(max(rank[v]["wire"] for rank in ranks) for ranks in mine)
            span = f"{statistics.median(times):.0f} [{min(times):.0f}-{max(times):.0f}]"
            lines.append(f"{rate:>8} {v:<11} {grad:>17,.0f} {fp32 / grad:>7.2f}x {wire / 1e6:>18.2f} {span:>22} "
                         f"{statistics.median(ms['fsdp fp32']) / statistics.median(times):>8.2f}x")
    return "\n".join(lines)
