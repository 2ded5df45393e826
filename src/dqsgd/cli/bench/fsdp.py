"""``dqsgd bench fsdp`` and the FSDP training example: gloo processes on 127.0.0.1, ``fully_shard`` per block.

Both run an MLP whose every ``Linear`` is its own FSDP unit, once with FSDP's own reduce-scatter
(fp32, or bf16 through ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``) and once per dqsgd
variant (:func:`variant`: a method on the reduce-scatter, ``ag8``/``ag4`` for the quantized parameter
all-gather, ``rep:<method>`` for HSDP's cross-node leg when the ranks form nodes, joined by ``+``).
Bytes are what each rank hands to the process group per step, for gradients and for the parameter
all-gathers: FSDP's own reduce-scatter sends (W−1)/W of its input, its all-gathers each unit's shard
to the W−1 others in forward and backward; dqsgd's are counted by :class:`~dqsgd.fsdp.FSDPState`
(payloads, size exchange, status, policy statistics, exact warm-up calls; the all-gather's frame headers).

With ``--rates`` (root, a source checkout) the W ranks run in network namespaces joined by a bridge
whose links are shaped with tc/tbf to each rate (``benchmarks/network/netns.py``, as ``dqsgd bench
network``), so the step time includes the real cost of moving FSDP's bytes — the parameter
all-gathers of forward and backward as well as the gradient reduce-scatter — and each rank's wire
bytes are read from its interface. With ``--nodes`` only the links between nodes get the rate, those
inside a node ``--node-rate``, and each rank's bytes to other nodes are read too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

DEFAULTS = ("fsdp fp32", "fsdp bf16")


@dataclass(frozen=True)
class Variant:
    """What a variant name asks for: ``+``-joined parts, each FSDP's default (``fsdp fp32``, ``fsdp bf16``),
    a method for the intra-node reduce-scatter (``qsgd-4bit``), the parameter all-gather's width
    (``ag8``, ``ag4``, ``ag32``) or, with nodes > 1, HSDP's replicate-leg method (``rep:qsgd-4bit``).
    ``qsgd-4bit+ag8``: both intra-node legs; ``ag8``: the all-gather only; ``rep:dqsgd``: the
    cross-node leg only; ``+wait``: every replicate leg waits for its result instead of overlapping
    the backward of the remaining units (to measure the overlap)."""

    name: str
    bf16: bool = False
    method: str | None = None
    param_bits: int | None = None
    replicate: str | None = None
    wait: bool = False


def variant(name: str) -> Variant:
    fields: dict[str, Any] = {}
    for part in name.split("+"):
        part = part.strip()
        if part in DEFAULTS:
            fields["bf16"] = part == "fsdp bf16"
        elif part in ("ag4", "ag8", "ag32"):
            fields["param_bits"] = int(part[2:])
        elif part.startswith("rep:"):
            fields["replicate"] = part[4:]
        elif part == "wait":
            fields["wait"] = True
        elif part:
            fields["method"] = part
        else:
            raise ValueError(f"variant {name!r}: an empty part")
    if fields.get("wait") and "replicate" not in fields:
        raise ValueError(f"variant {name!r}: +wait applies to a replicate leg (rep:<method>)")
    return Variant(name, **fields)


def mlp(sizes: list[int], world: int, name: str, total_steps: int, seed: int,
        nodes: int = 1) -> tuple[nn.Module, list[Any]]:
    """An MLP of ``sizes`` with each Linear (and the root) fully_shard-ed on a CPU mesh: 1-D over the
    ``world`` ranks, or with ``nodes`` > 1 HSDP's 2-D mesh (nodes × world/nodes); ``name``: a
    :func:`variant`. Returns (model, its dqsgd states: the FSDPState and the replicate leg's HookState
    where the variant has them)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dqsgd.ddp import HookState
    from dqsgd.fsdp import FSDPState, compress

    v = variant(name)
    if world % nodes:
        raise ValueError(f"{world} ranks do not split into {nodes} nodes")
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    mesh = init_device_mesh("cpu", (world,)) if nodes == 1 else init_device_mesh(
        "cpu", (nodes, world // nodes), mesh_dim_names=("replicate", "shard"))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if v.bf16 else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    state = None
    if v.method is not None or v.param_bits is not None:
        state = FSDPState(v.method or "sgd", seed=seed, total_steps=total_steps, timeout=120, param_bits=v.param_bits)
    rep = None
    if v.replicate is not None:
        if nodes == 1:
            raise ValueError(f"variant {name!r}: a replicate leg needs nodes > 1 (HSDP)")
        rep = HookState(v.replicate, mesh.get_group("replicate"), seed=seed, total_steps=total_steps, timeout=120)
    if state is not None or rep is not None:
        for comm in compress(model, state, gradients=v.method is not None, replicate=rep):
            if v.wait and hasattr(comm, "overlap"):
                comm.overlap = None  # the replicate leg waits for its result
    return model, [s for s in (state, rep) if s is not None]


def _padded(model: nn.Module, shards: int) -> int:
    """The model's parameters as FSDP pads them to ``shards`` equal shards (dim 0 rounded up)."""
    return sum(-(-p.shape[0] // shards) * shards * (p[0].numel() if p.dim() > 1 else 1) for p in model.parameters())


def leg_bytes(model: nn.Module, name: str, states: list[Any], world: int, steps: int,
              nodes: int = 1) -> tuple[int, int]:
    """Gradient bytes this rank has handed to its groups in ``steps`` steps, as (the reduce-scatter inside
    the node, HSDP's cross-node leg; 0 without nodes): dqsgd's legs as their states count them
    (payloads, sizes, statistics, downlink), FSDP's own computed — the reduce-scatter sends (S−1)/S of
    its input (S = world/nodes), HSDP's all-reduce a ring's 2·(R−1)/R of the shard (R = nodes)."""
    from dqsgd.ddp import HookState
    from dqsgd.fsdp import FSDPState

    v = variant(name)
    itemsize = 2 if v.bf16 else 4
    S, R = world // nodes, nodes
    padded = _padded(model, S)
    fsdp = [s for s in states if isinstance(s, FSDPState)]
    hook = [s for s in states if isinstance(s, HookState)]
    inner = fsdp[0].compression_stats().uplink_sent if v.method is not None else steps * (
        (S - 1) * padded * itemsize // S)
    cross = hook[0].compression_stats().bytes_sent if hook else steps * (2 * (R - 1) * (padded // S) * itemsize // R)
    return inner, cross


def gradient_bytes(model: nn.Module, name: str, states: list[Any], world: int, steps: int, nodes: int = 1) -> int:
    """Both gradient legs of :func:`leg_bytes` together."""
    return sum(leg_bytes(model, name, states, world, steps, nodes))


def exact_param_bytes(model: nn.Module, world: int, nodes: int = 1) -> int:
    """What FSDP's own fp32 parameter all-gathers send per rank and step: each unit's shard to the S−1
    other ranks of its node, once for the forward and once for the backward (S = world/nodes)."""
    S = world // nodes
    return 2 * (S - 1) * 4 * (_padded(model, S) // S)


def _bench_rank(rank: int, world: int, args: argparse.Namespace, wire: Callable[[], int] | None = None,
                cross: Callable[[], int] | None = None) -> dict[str, Any]:
    """Every variant's median step time, gradient and parameter all-gather bytes per step and time inside
    dqsgd's calls, both legs (and, given ``wire``, the bytes this rank's interface sent per timed step;
    given ``cross``, those of them that went to other nodes)."""
    from dqsgd.fsdp import FSDPState

    sizes = [int(s) for s in args.sizes.split(",")]
    out: dict[str, Any] = {}
    for name in [*DEFAULTS, *args.methods.split(",")]:
        nodes = getattr(args, "nodes", 1)  # HSDP: the ranks as nodes × world/nodes (2-D mesh)
        model, states = mlp(sizes, world, name, args.warmup + args.steps, 0, nodes)
        fsdp = [st for st in states if isinstance(st, FSDPState)]
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
                before = leg_bytes(model, name, states, world, s + 1, nodes)
                dq_before = fsdp[0].seconds if fsdp else 0.0
                ag_before = _param_bytes(fsdp)
                tx = wire() if wire is not None else 0
                tx_cross = cross() if cross is not None else 0
        after = leg_bytes(model, name, states, world, args.warmup + args.steps, nodes)
        dq_ms = 1000 * (fsdp[0].seconds - dq_before) / args.steps if fsdp else float("nan")
        out[name] = {"ms": 1000 * statistics.median(times), "bytes": (sum(after) - sum(before)) / args.steps,
                     "dqsgd_ms": dq_ms}
        if nodes > 1:  # HSDP: the cross-node leg's share of "bytes"
            out[name]["cross_bytes"] = (after[1] - before[1]) / args.steps
        # the parameter all-gathers: dqsgd's (payloads and frame headers) as counted, or FSDP's exact fp32
        out[name]["param_bytes"] = ((_param_bytes(fsdp) - ag_before) / args.steps if variant(name).param_bits
                                    is not None else exact_param_bytes(model, world, nodes))
        if wire is not None:
            out[name]["wire"] = (wire() - tx) / args.steps
        if cross is not None:
            out[name]["cross_wire"] = (cross() - tx_cross) / args.steps
    return out


def _param_bytes(states: list[Any]) -> int:
    return sum(st.param_sent + st.param_side for st in states)


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
    nodes = getattr(args, "nodes", 1)
    mesh = f", HSDP {nodes} nodes x {args.world // nodes}" if nodes > 1 else ""
    print(f"FSDP2 on loopback, W = {args.world} gloo ranks (CPU){mesh}, MLP {args.sizes}, batch {args.batch}/rank, "
          f"median of {args.steps} steps after {args.warmup}")
    print(table([r.value for r in results]))
    if args.out:
        save(args.out, {"args": vars(plain), "ranks": [r.value for r in results]})


def _bytes_columns(ranks: list[dict[str, Any]], name: str) -> tuple[float, float, float]:
    """The busiest rank's gradient, parameter all-gather and cross-node bytes per step (each its own
    busiest rank), and their sum's busiest rank: (grad, param, total); cross in :func:`_cross`."""
    grad = max(rank[name]["bytes"] for rank in ranks)
    param = max(rank[name]["param_bytes"] for rank in ranks)
    total = max(rank[name]["bytes"] + rank[name]["param_bytes"] for rank in ranks)
    return grad, param, total


BYTES_HEADER = f"{'grad B/rank/step':>17} {'param AG B':>11} {'total B':>11} {'vs fp32':>8}"


def _bytes_cells(ranks: list[dict[str, Any]], name: str) -> str:
    grad, param, total = _bytes_columns(ranks, name)
    return f"{grad:>17,.0f} {param:>11,.0f} {total:>11,.0f} {_bytes_columns(ranks, 'fsdp fp32')[2] / total:>7.2f}x"


def table(ranks: list[dict[str, Any]]) -> str:
    """One row per variant: the busiest rank's bytes per step — gradients (both legs under HSDP), the
    parameter all-gathers, their total and its ratio to FSDP fp32's — rank 0's median step time and
    its speed-up over FSDP fp32, and rank 0's time inside dqsgd's FSDP calls (reduce-scatter and
    all-gather; nan where neither is dqsgd's: HSDP's replicate leg alone is not timed)."""
    rows, ref = ranks[0], ranks[0]["fsdp fp32"]
    width = max(14, *map(len, rows))
    lines = [f"{'variant':<{width}} {BYTES_HEADER} {'ms/step':>9} {'speed-up':>9} {'ms in dqsgd calls':>18}"]
    for name, r in rows.items():
        lines.append(f"{name:<{width}} {_bytes_cells(ranks, name)} {r['ms']:>9.1f} {ref['ms'] / r['ms']:>8.2f}x "
                     f"{r['dqsgd_ms']:>18.1f}")
    return "\n".join(lines)


def save(path: str, record: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1, default=str))
    print(f"\nwrote {path}")


# --- on shaped links (network namespaces) -----------------------------------------------------------
def bench_shaped(args: argparse.Namespace, netns: Any) -> None:
    """Every rate of ``args.rates`` × ``args.repeats``: W ranks, each in its own namespace (``netns``:
    the checkout's ``benchmarks/network/netns.py``) on a link shaped to the rate — with ``args.nodes`` > 1
    only the links between nodes, those inside a node get ``args.node_rate`` — run :func:`_bench_rank`;
    then the table (:func:`shaped_table`)."""
    import tempfile

    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    nodes, fast = getattr(args, "nodes", 1), getattr(args, "node_rate", None)
    for rate in rates:
        netns.shaping_plan(args.world, rate, nodes, fast)  # bad rates are refused before any namespace is made
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
            net.shape(rate, nodes, fast)
            for rep in range(args.repeats):
                result = Path(tmp, f"{rate}-{rep}")
                netns.run_ranks(net, lambda r: [sys.executable, "-c", RANK_MAIN, str(Path(tmp, "args.json")), str(r),
                                                net.address(0), str(result)], env, args.deadline, f"bench fsdp at {rate}")
                ranks = [json.loads(Path(f"{result}.{r}").read_text()) for r in range(args.world)]
                runs.append({"rate": rate, "repeat": rep, "ranks": ranks})
                print(f"{rate} #{rep}: " + ", ".join(f"{v} {ranks[0][v]['ms']:.0f} ms/step" for v in ranks[0]), flush=True)
    mesh = f", HSDP {nodes} nodes x {args.world // nodes} (links inside a node: {fast})" if nodes > 1 else ""
    print(f"\nFSDP2 on shaped links, W = {args.world} gloo ranks (CPU){mesh}, MLP {args.sizes}, batch {args.batch}/rank, "
          f"median of {args.steps} steps after {args.warmup}, {args.repeats} repeat(s)")
    print(shaped_table(runs))
    if args.out:
        save(args.out, {"args": vars(args), "runs": runs})


# What a rank process runs (``python -c``): the wire counter is the checkout's netns.tx_bytes.
RANK_MAIN = ("import sys; from dqsgd.cli.bench.parser import load_script; "
             "from dqsgd.cli.bench.fsdp import rank_main; m = load_script('network/netns.py'); "
             "rank_main(sys.argv[1:], m.tx_bytes, m.cross_node_bytes)")


def rank_main(argv: list[str], wire: Callable[[], int], cross: Callable[[], int] | None = None) -> None:
    """One rank inside its namespace: ``ARGS.json RANK MASTER RESULT`` (writes ``RESULT.<rank>``);
    ``wire()``: the bytes the namespace's interface has sent; ``cross()``, with nodes > 1, those of
    them sent to other nodes."""
    import datetime

    import torch.distributed as dist

    path, rank, master, result = argv
    args = argparse.Namespace(**json.loads(Path(path).read_text()))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:29500", rank=int(rank), world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        out = _bench_rank(int(rank), args.world, args, wire, cross if getattr(args, "nodes", 1) > 1 else None)
        Path(f"{result}.{rank}").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def shaped_table(runs: list[dict[str, Any]]) -> str:
    """Per rate and variant: the bytes of :func:`table` and the wire bytes per step (busiest rank; the
    median over repeats), under HSDP also those sent to other nodes, the step time (rank 0's median;
    the median over repeats and their range) and the speed-up over FSDP fp32 and bf16."""
    hsdp = "cross_wire" in runs[0]["ranks"][0]["fsdp fp32"]
    width = max(11, *(len(v) for v in runs[0]["ranks"][0]))
    lines = [f"{'rate':>8} {'variant':<{width}} {BYTES_HEADER} {'wire MB':>8}" + (f" {'x-node MB':>9}" if hsdp else "")
             + f" {'ms/step [range]':>22} {'vs fp32':>8} {'vs bf16':>8}"]
    for rate in dict.fromkeys(r["rate"] for r in runs):
        mine = [r["ranks"] for r in runs if r["rate"] == rate]
        ms = {v: statistics.median(ranks[0][v]["ms"] for ranks in mine) for v in mine[0][0]}
        for v in ms:
            times = [ranks[0][v]["ms"] for ranks in mine]
            wire = [statistics.median(max(rank[v][k] for rank in ranks) for ranks in mine)
                    for k in ("wire", "cross_wire")[:1 + hsdp]]
            span = f"{ms[v]:.0f} [{min(times):.0f}-{max(times):.0f}]"
            lines.append(f"{rate:>8} {v:<{width}} {_bytes_cells(mine[0], v)} "
                         + " ".join(f"{w / 1e6:>{8 + (i > 0)}.2f}" for i, w in enumerate(wire))
                         + f" {span:>22} {ms['fsdp fp32'] / ms[v]:>7.2f}x {ms['fsdp bf16'] / ms[v]:>7.2f}x")
    return "\n".join(lines)
