"""Bandwidth-limited end-to-end benchmark: time to a target accuracy under DDP, per gradient compressor.

    sudo .venv/bin/python benchmarks/network/bench_network.py              # 100 Mbit/s, MLP on MNIST to 92%
    sudo .venv/bin/python benchmarks/network/bench_network.py --rates 100mbit,1gbit --target 0.95 --steps 800
    sudo .venv/bin/python benchmarks/network/bench_network.py --model cnn --methods fp32,qsgd-4bit,dqsgd
    sudo .venv/bin/python benchmarks/network/bench_network.py --methods fp32,powersgd-r2,qsgd-2bit@4,dqsgd-coded@auto
    sudo .venv/bin/python benchmarks/network/bench_network.py --methods fp32,sgd-ps,sgd-backup1,sketched-sgd-trainer
    sudo .venv/bin/python benchmarks/network/bench_network.py --methods fp32,postlocal-h16,local-h16,local-h16-qsgd-4bit

W ranks (default 4), each in its own network namespace, joined by veth pairs to a bridge; every link
is shaped with tc/tbf to ``rate`` each way (see netns.py: only addresses 10.99.0.x inside the
namespaces are used). The same model, data shards, seed and optimizer are trained with plain DDP
(fp32 all-reduce), PyTorch's fp16_compress_hook and powerSGD_hook (rank 1), and dqsgd's DDP hook
with any registered dqsgd method (`dqsgd methods`; the defaults are QSGD 4-bit and DQSGD, budgeted, 4.5
bits on average); ``powersgd-rN`` runs PowerSGD at rank N. A dqsgd method name alone runs the hook
on its default topology ``sharded`` (every rank serves 1/W of each bucket: an all-to-all of 4-bit
shards up, an all-gather of averaged shards quantized at ``--downlink-bits`` down, default 8);
``@auto`` (or ``--downlink-bits auto``) gives the budgeted methods the both-leg budget split that
the hook and the trainer use by default; ``-allgather``, ``-trainer``, ``-ps`` and ``-backupB``
(synchronous SGD with B backup workers on a parameter server) and the other ``@DOWN`` widths are
described in method_rows.py, which says why Sketched SGD runs only as a trainer row;
``local-hH[-METHOD]``, ``CONFIG:LABEL[+KEY=VALUE...]`` (a config's Local SGD method: DiLoCo's outer
Nesterov, streaming fragments with overlap, the error-fed downlink) and ``postlocal-hH`` are Local SGD rows
(local_rows.py: dqsgd's LocalSGDOptimizer, and PyTorch's PostLocalSGDOptimizer as the uncompressed peer).
Every rank first runs ``--warmup`` untimed steps on a throwaway copy of its model and
hook (numba compilation, gloo connections; a Local SGD row at least until its first exchange's result is
applied, H + τ steps), then trains from the same initial weights.
Reported per (rate, method):

* time to target — training wall time on rank 0 until the test accuracy (evaluated every
  ``--eval-every`` steps on ``--eval-samples`` test images; evaluation time excluded) first reaches
  ``--target``; "—" if it never does within ``--steps``;
* wire MB — bytes the ranks' interfaces really sent (``tx_bytes`` of each namespace's eth0, TCP/IP and
  gloo framing included), summed over ranks, from the first to the last training step;
* link s — modelled network time: the busiest rank's wire bytes at the shaped rate (what the link
  alone costs, whatever the shared CPU did);
* final accuracy, steps run, mean step time, and for the dqsgd hooks the measured compression
  ratio of the gradient payloads (fp32 bytes / payload bytes).

Output: a table on stdout, ``network.json`` and ``network.png`` under ``--out``. Needs root and
iproute2; without them it prints why and exits 0 (skipped). One process per rank on a 2-core
machine: compute is slow and shared, so compare methods within one run; the wire bytes do not
depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the helpers beside the script (run as a script, or loaded by dqsgd bench)

from local_rows import (LOCAL_SYNTAX, is_local, local_problem, local_row, local_stepper, training_step,  # noqa: E402,F401
                        warmup_steps)
from net_tables import grouped, link_s, peak_step, plot, speedup, table, time_to_target  # noqa: E402,F401

from method_rows import (BACKUP, METHOD_SYNTAX as DQSGD_SYNTAX, TORCH_HOOKS, VARIANTS, backup_workers,  # noqa: E402,F401
                         down_ok, downlink, downlink_options, dqsgd_problem, powersgd_rank, split_downlink, variant)

DEFAULT_METHODS = ("fp32", "fp16", "powersgd", "qsgd-4bit", "dqsgd", "qsgd-4bit-allgather", "dqsgd-allgather")
METHOD_SYNTAX = DQSGD_SYNTAX + " | " + LOCAL_SYNTAX


def method_problem(method: str, workers: int | None = None) -> str:
    """Why ``method`` is not a row this benchmark can run ("" if it is); ``workers``: W, where known."""
    if method in ("fp32", "fp16") or powersgd_rank(method) is not None:
        return ""
    if is_local(method):
        return local_problem(method)
    return dqsgd_problem(method, workers)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rates", default="100mbit", help="comma-separated tc rates per link and direction")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated rows: {METHOD_SYNTAX}")
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--model", default="mlp", help="a dqsgd model name: mlp (199k parameters, cheap to compute, so "
                   "the link is the bottleneck), cnn (LeNet-5, 62k parameters, compute-bound on 2 cores)")
    p.add_argument("--hidden", default="", help="mlp only: comma-separated hidden widths (default 200,200; "
                   "1024,1024 gives 1.86M parameters)")
    p.add_argument("--downlink-bits", default="8", help="width of the sharded downlink of the rows without @DOWN, "
                   "2..16 or fp32, or auto: every row's method default (the both-leg budget split for dqsgd and "
                   "dqsgd-coded, 8 for the others); a trailing 'e' (e.g. 2e) makes it error-fed")
    p.add_argument("--downlink-target-bits", type=float, default=0.0, help="rows with the both-leg split (auto): the "
                   "downlink's share of the budget, bits per coordinate and step (0: an 8-bit fixed downlink's cost)")
    p.add_argument("--link-mbit", type=float, default=0.0, help="the link policy's rows (dqsgd-link): the link "
                   "rate they state, Mbit/s (default 0: the hook measures the link at its first call)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps on a throwaway copy of model and hook (a "
                   "Local SGD row: at least until its first exchange's result is applied)")
    p.add_argument("--repeats", type=int, default=1, help="runs per (rate, method), interleaved; the table gives "
                   "the median time to target")
    p.add_argument("--steps", type=int, default=500, help="most steps per run")
    p.add_argument("--target", type=float, default=0.92, help="test accuracy that stops a run")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-samples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel", default="fused", choices=("torch", "fused"),
                   help="dqsgd's uniform quantizer: fused numba kernels with hash uniforms, or torch ops")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it is killed (the run "
                   "is then reported as failed, and the others go on; the exit status is 1)")
    p.add_argument("--out", default="runs/bench-network")
    p.add_argument("--force", action="store_true", help="replace the results already in --out")
    # internal: one rank inside its namespace
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- one rank ---------------------------------------------------------------------------------------
def register_hook(model: Any, a: argparse.Namespace) -> Any:
    """Attach the method's DDP communication hook; returns its state (None for plain DDP)."""
    if a.method == "fp32":
        return None
    if a.method == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if powersgd_rank(a.method) is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank(a.method) or 1,
                                 start_powerSGD_iter=2,
                                 random_seed=a.seed)
        model.register_comm_hook(state, ps.powerSGD_hook)
        return state
    import dqsgd.ddp

    base, _, topology = variant(a.method)
    state = dqsgd.ddp.HookState(method=row_config(base, a), process_group=None, seed=a.seed,
                                total_steps=a.steps, topology=topology, downlink_bits=downlink(a),
                                **downlink_options(a))
    model.register_comm_hook(state, dqsgd.ddp.hook)
    return state


def row_config(base: str, a: argparse.Namespace) -> Any:
    """The method config of a dqsgd hook row: the link policy's on ``--link-mbit`` (0: measured)."""
    from dqsgd.method.config import method_config

    config = method_config(base, kernel=a.kernel)
    return method_config(base, kernel=a.kernel, link_mbit=a.link_mbit) if config.policy == "link" else config


def _build(a: argparse.Namespace, data: Any) -> Any:
    from dqsgd.models import build_model

    options = {"hidden": tuple(int(h) for h in a.hidden.split(","))} if a.hidden else {}
    return build_model(a.model, data, **options)


def _ddp_stepper(a: argparse.Namespace, data: Any) -> tuple[Any, Any, Any]:
    """(one training step of rank ``a.rank`` at step n, the model to evaluate, the hook's state) under DDP."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dqsgd.train.sampling import MODEL_INIT, seed_for

    torch.manual_seed(seed_for(a.seed, MODEL_INIT))
    # PowerSGD's hook waits on a nested all-reduce inside its future callback: on gloo, two buckets in
    # flight occupy both of the process group's worker threads and it deadlocks (seen with the 1.86M MLP,
    # whose default first bucket is 1 MB). An explicit 25 MB cap makes the first bucket 25 MB too: one bucket.
    model = DDP(_build(a, data), bucket_cap_mb=25 if powersgd_rank(a.method) else None)
    state = register_hook(model, a)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    return training_step(a, data, model, opt), model.module, state


def _trainer_stepper(a: argparse.Namespace, data: Any) -> tuple[Any, Any, Any]:
    """The same for dqsgd's trainer (same init, batches and optimizer; Sketched SGD: its workers' momentum
    ``sketch_momentum`` in place of the optimizer's) on the row's topology; ``-backupB`` rows on a
    parameter server of their own process group that aggregates the first W − B uplinks."""
    import torch.distributed as dist

    from dqsgd.method.config import method_config
    from dqsgd.train.config import MethodEntry, TrainConfig
    from dqsgd.train.trainer import Trainer
    from dqsgd.transport.backup import BackupPSTransport
    from dqsgd.transport.torch_dist import make_transport

    base, _, topology = variant(a.method)
    dbits, backup, config = downlink(a), backup_workers(a.method), method_config(base, kernel=a.kernel)
    cfg = TrainConfig(name="bench-network", dataset=a.dataset, model=a.model, workers=a.workers, steps=a.steps,
                      batch_size=a.batch_size, lr=a.lr, momentum=a.momentum, topology=topology,
                      downlink_bits={"fp32": 32, None: 0}.get(dbits, dbits),  # type: ignore[arg-type]
                      threads=a.threads, backup_workers=backup, coded_every=0 if backup else 1, **downlink_options(a))
    # A backup server leaves receives posted for the stragglers: a group of its own keeps them off the
    # next run's messages (the warm-up's trainer, then the timed one).
    transport = (BackupPSTransport(backup, dist.new_group(), timeout=a.timeout) if backup
                 else make_transport(topology, timeout=a.timeout))
    momentum = 0.0 if config.scheme == "sketch" else None
    tr = Trainer(cfg, MethodEntry(base, config, momentum=momentum), data, a.seed, transport)
    return lambda n: tr.step(), tr.model, tr


def stepper(a: argparse.Namespace, data: Any) -> tuple[Any, Any, Any]:
    if is_local(a.method):
        return local_stepper(a, data, lambda: _build(a, data))
    v = variant(a.method)
    return (_trainer_stepper if v is not None and v[1] == "trainer" else _ddp_stepper)(a, data)


def run_rank(a: argparse.Namespace) -> None:
    """One rank: warm-up, then training to ``--steps`` or until rank 0 sees the target (``-backupB`` rows: to
    ``--steps``, see :func:`_evaluate`), then its interface's bytes to rank 0, which writes the result."""
    import datetime

    import torch
    import torch.distributed as dist

    from dqsgd.data import load_dataset
    from netns import tx_bytes

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:29500", rank=a.rank, world_size=a.workers,
                            timeout=datetime.timedelta(seconds=a.timeout))
    data = load_dataset(a.dataset)
    warmup = warmup_steps(a.method, a.warmup)
    if warmup:  # a throwaway copy: compilation and first connections happen outside the timed loop
        warm, _, warm_state = stepper(a, data)
        if backup_workers(a.method):  # its server reads the stragglers' last uplinks after the warm-up
            warm_state.transport.expect(warmup)
        for n in range(warmup):
            warm(n)
        if is_local(a.method) and hasattr(warm_state, "finish"):  # no exchange of the copy left in flight
            warm_state.finish()
    train_step, model, state = stepper(a, data)
    train_s, curve, reached, acc, step, link, trace = 0.0, [], None, float("nan"), 0, {}, []
    dist.barrier()
    tx0 = tx_bytes()
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        train_step(step - 1)
        train_s += time.perf_counter() - t0
        if a.rank == 0:  # rank 0's clock and its interface's bytes after every step: peak bytes per step
            trace.append([round(train_s, 5), tx_bytes() - tx0])
        link_choices(state, link)
        if step % a.eval_every == 0 or step == a.steps:
            acc, stop = _evaluate(a, data, model, step, train_s, curve, tx_bytes() - tx0, reached)
            if reached is None and acc >= a.target:  # rank 0 only (nan elsewhere)
                reached = {"step": step, "train_s": train_s}
            if stop:
                break
    sent = torch.tensor([tx_bytes() - tx0], dtype=torch.int64)
    every = [torch.zeros_like(sent) for _ in range(a.workers)]
    dist.all_gather(every, sent)
    if a.rank == 0:
        Path(a.result).write_text(json.dumps({**_result(a, step, acc, train_s, reached, curve, every, state), **link,
                                              "trace": trace}))
    dist.destroy_process_group()


def link_choices(state: Any, out: dict[str, Any]) -> None:
    """A link-policy row (``dqsgd-link``): each bucket's choice sent at the step just run, "up/down/coding" (0: the
    bucket in its dtype), appended to ``out["link_choices"]``, and the link it measured (``out["link"]``)."""
    buckets = getattr(state, "_buckets", None)
    if not buckets or getattr(state.config, "policy", "") != "link":
        return
    out["link"] = state.link
    out.setdefault("link_choices", []).append(
        [f"{b.bits}/{b.proto.down_width(b.policy) if b.bits else 0}/{b.policy.coding}" for _, b in sorted(buckets.items())])


def _evaluate(a: argparse.Namespace, data: Any, model: Any, step: int, train_s: float, curve: list[Any],
              sent: int, reached: Any) -> tuple[float, bool]:
    """Rank 0's test accuracy at ``step`` (appended to ``curve``; nan elsewhere), and whether every rank stops.

    The others wait in a broadcast while rank 0 evaluates (not counted as training). Not under backup
    workers: there a dropped worker's uplink completes only when the server reads it, at its next
    exchange, so a collective between steps would wait for it forever; those rows train to ``--steps``
    (rank 0 still records when it reached the target) and the server reads the last stragglers after
    the last exchange (:meth:`~dqsgd.transport.backup.BackupPSTransport.expect`)."""
    import torch
    import torch.distributed as dist

    acc = float("nan")
    if a.rank == 0:
        with torch.no_grad():
            model.eval()
            x, y = data.test.x[: a.eval_samples], data.test.y[: a.eval_samples]
            acc = float((model(x).argmax(1) == y).float().mean())
            model.train()
        curve.append({"step": step, "train_s": train_s, "acc": acc, "tx_bytes": sent})
    if backup_workers(a.method):
        return acc, False
    stop = torch.tensor([float(a.rank == 0 and (reached is not None or acc >= a.target))])
    dist.broadcast(stop, 0)
    return acc, bool(stop[0] > 0)


def _result(a: argparse.Namespace, step: int, acc: float, train_s: float, reached: Any, curve: list[Any],
            every: list[Any], state: Any) -> dict[str, Any]:
    import dqsgd.ddp
    from dqsgd.train.trainer import Trainer

    ratio = bits = None
    backup: dict[str, Any] = {}
    if isinstance(state, dqsgd.ddp.HookState):
        stats = state.compression_stats()
        ratio, bits = stats.ratio, stats.mean_bits
    elif isinstance(state, Trainer):
        ratio, bits = state.ledger.compression_ratio(), state.ledger.mean_bits()
        if backup_workers(a.method):  # the workers whose uplink the server did not wait for, per step
            backup = {"dropped": [list(r.dropped) for r in state.ledger.records],
                      "wasted_up_bytes": state.ledger.wasted_up_bytes}
    per_rank = [int(t) for t in every]
    return {"method": a.method, "steps": step, "final_acc": acc, "train_s": train_s, "reached": reached,
            "wire_bytes": sum(per_rank), "wire_bytes_per_rank": per_rank, "curve": curve,
            "payload_ratio": ratio, "mean_bits": bits, **backup}


# --- the orchestrator -------------------------------------------------------------------------------
def launch(net: Any, a: argparse.Namespace, method: str, result: Path) -> None:
    """Start every rank in its namespace; kill the whole run past ``--timeout`` or if one rank fails."""
    from netns import run_ranks

    # TORCH_CPP_LOG_LEVEL: the namespaces have no name service, and c10d warns about it on every connect.
    path = os.pathsep.join(filter(None, (str(HERE), os.environ.get("PYTHONPATH"))))  # the caller's dqsgd too
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    run_ranks(net, lambda r: [sys.executable, str(Path(__file__).resolve()), "--rank", str(r), "--method", method,
                              "--master", net.address(0), "--result", str(result), *_forward(a)],
              env, a.timeout + 30, method)


def _forward(a: argparse.Namespace) -> list[str]:
    keys = ("workers", "dataset", "model", "hidden", "downlink_bits", "downlink_target_bits", "link_mbit", "warmup", "steps", "target",
            "batch_size", "lr", "momentum", "eval_every", "eval_samples", "seed", "timeout", "kernel")
    return [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(a, k)))]


def check_args(a: argparse.Namespace, methods: list[str]) -> str:
    """What is wrong with the options ("" if nothing)."""
    bad = [p for p in (method_problem(m, a.workers) for m in methods) if p]
    if bad:
        return "; ".join(bad) + f" (rows: {METHOD_SYNTAX})"
    if a.workers < 2:
        return f"--workers must be >= 2, got {a.workers}"
    if a.hidden and (a.model != "mlp" or any((variant(m) or ("", ""))[1] == "trainer" for m in methods)):
        return "--hidden applies to --model mlp under DDP only (the trainer's rows build the config's model)"
    if a.hidden and not all(h.strip().isdigit() and int(h) > 0 for h in a.hidden.split(",")):
        return f"--hidden must be comma-separated positive widths, got {a.hidden!r}"
    if not down_ok(a.downlink_bits):
        return f"--downlink-bits must be 2..16, fp32 or auto (error-fed: 2e..16e, autoe), got {a.downlink_bits!r}"
    if a.repeats < 1 or a.warmup < 0:
        return "--repeats must be >= 1 and --warmup >= 0"
    return ""


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.rank is not None:
        run_rank(a)
        return 0
    from netns import NetworkUnavailable, PrivateNetwork

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    problem = check_args(a, methods)
    if problem:
        print(f"bench network: {problem}", file=sys.stderr)
        return 2
    out = Path(a.out)
    if (out / "network.json").exists() and not a.force:
        print(f"bench network: {out / 'network.json'} exists: choose another --out, or --force to replace it",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    try:
        net = PrivateNetwork(a.workers)
    except NetworkUnavailable as e:
        print(f"bench network: skipped: {e}")
        return 0
    rows: list[dict[str, Any]] = []
    with net, tempfile.TemporaryDirectory(prefix="dqsgd-bench-") as tmp:
        for rate in [r.strip() for r in a.rates.split(",") if r.strip()]:
            net.shape(rate)
            for rep in range(a.repeats):  # interleaved: a slow spell of the shared machine hits every method
                for method in methods:
                    res = Path(tmp, f"{rate}-{method}-{rep}.json")
                    start = time.perf_counter()
                    try:
                        launch(net, a, method, res)
                    except RuntimeError as e:  # recorded as failed; the other runs go on
                        rows.append({"rate": rate, "method": method, "repeat": rep, "error": str(e)})
                        print(f"{rate} {method} #{rep}: FAILED: {e}", flush=True)
                        continue
                    row = {"rate": rate, "repeat": rep, **json.loads(res.read_text()),
                           "run_s": time.perf_counter() - start}
                    rows.append(row)
                    reached = f"{row['reached']['train_s']:.1f} s" if row["reached"] else "not reached"
                    print(f"{rate} {method} #{rep}: {row['steps']} steps, acc {row['final_acc']:.4f}, target "
                          f"{reached}, {row['wire_bytes'] / 1e6:.1f} MB on the wire, {row['run_s']:.0f} s in all",
                          flush=True)
    print()
    print(table(rows, a.target))
    facts = {k: getattr(a, k) for k in ("workers", "rates", "dataset", "model", "hidden", "downlink_bits",
                                        "downlink_target_bits", "link_mbit", "warmup",
                                        "repeats", "steps", "target", "batch_size", "lr", "momentum", "eval_every",
                                        "eval_samples", "seed", "kernel")}
    command = "sudo .venv/bin/python benchmarks/network/bench_network.py " + " ".join(
        shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    (out / "network.json").write_text(json.dumps({"command": command, "config": facts, "runs": rows}, indent=2))
    (out / "table.txt").write_text(f"{command}\n\n{table(rows, a.target)}\n")
    plot(rows, a.target, out / "network.png")
    print(f"\n{out / 'network.json'}, {out / 'table.txt'}, {out / 'network.png'}")
    failed = [f"{r['rate']} {r['method']} #{r['repeat']}" for r in rows if "error" in r]
    if failed:
        print(f"bench network: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
