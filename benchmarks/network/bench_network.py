"""Bandwidth-limited end-to-end benchmark: time to a target accuracy under DDP, per gradient compressor.

    sudo .venv/bin/python benchmarks/network/bench_network.py              # 100 Mbit/s, MLP on MNIST to 92%
    sudo .venv/bin/python benchmarks/network/bench_network.py --rates 100mbit,1gbit --target 0.95 --steps 800
    sudo .venv/bin/python benchmarks/network/bench_network.py --model cnn --methods fp32,qsgd-4bit,dqsgd

W ranks (default 4), each in its own network namespace, joined by veth pairs to a bridge; every link
is shaped with tc/tbf to ``rate`` each way (see netns.py: only addresses 10.99.0.x inside the
namespaces are used). The same model, data shards, seed and optimizer are trained with plain DDP
(fp32 all-reduce), PyTorch's fp16_compress_hook and powerSGD_hook (rank 1), and dqsgd's DDP hook
with QSGD 4-bit and DQSGD (budgeted, 4.5 bits on average); ``qsgd-4bit-sharded`` and
``dqsgd-sharded`` run the same methods through dqsgd's own trainer on the ``sharded`` topology
(every rank serves 1/W of the gradient: an all-to-all of 4-bit shards up, an all-gather of 8-bit
averaged shards down; same data order, init and optimizer). Reported per (rate, method):

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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
METHODS = ("fp32", "fp16", "powersgd", "qsgd-4bit", "dqsgd", "qsgd-4bit-sharded", "dqsgd-sharded")
SHARDED = "-sharded"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rates", default="100mbit", help="comma-separated tc rates per link and direction")
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--model", default="mlp", help="a dqsgd model name: mlp (199k parameters, cheap to compute, so "
                   "the link is the bottleneck), cnn (LeNet-5, 62k parameters, compute-bound on 2 cores)")
    p.add_argument("--steps", type=int, default=500, help="most steps per run")
    p.add_argument("--target", type=float, default=0.92, help="test accuracy that stops a run")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-samples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel", default="fused", choices=("torch", "fused"),
                   help="dqsgd's uniform quantizer: fused numba kernels with hash uniforms, or torch ops")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it is killed")
    p.add_argument("--out", default="runs/bench-network")
    # internal: one rank inside its namespace
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- one rank ---------------------------------------------------------------------------------------
def register_hook(model: Any, method: str, steps: int, seed: int, kernel: str) -> Any:
    """Attach the method's DDP communication hook; returns its state (None for plain DDP)."""
    if method == "fp32":
        return None
    if method == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                 random_seed=seed)
        model.register_comm_hook(state, ps.powerSGD_hook)
        return state
    import dqsgd.ddp
    from dqsgd.methods import method_config

    state = dqsgd.ddp.HookState(method=method_config(method, kernel=kernel), process_group=None, seed=seed,
                                total_steps=steps)
    model.register_comm_hook(state, dqsgd.ddp.hook)
    return state


def _ddp_stepper(a: argparse.Namespace, data: Any) -> tuple[Any, Any, Any]:
    """(one training step of rank ``a.rank`` at step n, the model to evaluate, the hook's state) under DDP."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dqsgd.models import build_model
    from dqsgd.train.sampling import MODEL_INIT, WorkerBatches, seed_for

    torch.manual_seed(seed_for(a.seed, MODEL_INIT))
    model = DDP(build_model(a.model, data))
    state = register_hook(model, a.method, a.steps, a.seed, a.kernel)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    batches = WorkerBatches(len(data.train.y), a.workers, a.batch_size, a.seed)

    def step(n: int) -> None:
        idx = batches.indices(a.rank, n)
        loss = F.cross_entropy(model(data.train.x[idx]), data.train.y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step, model.module, state


def _sharded_stepper(a: argparse.Namespace, data: Any) -> tuple[Any, Any, Any]:
    """The same for dqsgd's trainer on the sharded topology (same init, batches and optimizer)."""
    from dqsgd.methods import method_config
    from dqsgd.train.config import MethodEntry, TrainConfig
    from dqsgd.train.trainer import Trainer
    from dqsgd.transport.torch_dist import make_transport

    base = a.method.removesuffix(SHARDED)
    cfg = TrainConfig(name="bench-network", dataset=a.dataset, model=a.model, workers=a.workers, steps=a.steps,
                      batch_size=a.batch_size, lr=a.lr, momentum=a.momentum, topology="sharded", threads=a.threads)
    tr = Trainer(cfg, MethodEntry(base, method_config(base, kernel=a.kernel)), data, a.seed,
                 make_transport("sharded", timeout=a.timeout))
    return lambda n: tr.step(), tr.model, tr


def run_rank(a: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from dqsgd.data import load_dataset
    from netns import tx_bytes

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:29500", rank=a.rank, world_size=a.workers,
                            timeout=datetime.timedelta(seconds=a.timeout))
    data = load_dataset(a.dataset)
    train_step, model, state = (_sharded_stepper if a.method.endswith(SHARDED) else _ddp_stepper)(a, data)
    tx_x, tx_y = data.test.x[: a.eval_samples], data.test.y[: a.eval_samples]
    train_s, curve, reached, acc, step = 0.0, [], None, float("nan"), 0
    dist.barrier()
    tx0 = tx_bytes()
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        train_step(step - 1)
        train_s += time.perf_counter() - t0
        if step % a.eval_every == 0 or step == a.steps:
            stop = torch.zeros(1)
            if a.rank == 0:
                with torch.no_grad():
                    model.eval()
                    acc = float((model(tx_x).argmax(1) == tx_y).float().mean())
                    model.train()
                curve.append({"step": step, "train_s": train_s, "acc": acc, "tx_bytes": tx_bytes() - tx0})
                if reached is None and acc >= a.target:
                    reached = {"step": step, "train_s": train_s}
                stop[0] = float(reached is not None)
            dist.broadcast(stop, 0)  # the others wait here while rank 0 evaluates (not counted as training)
            if stop[0] > 0:
                break
    sent = torch.tensor([tx_bytes() - tx0], dtype=torch.int64)
    every = [torch.zeros_like(sent) for _ in range(a.workers)]
    dist.all_gather(every, sent)
    if a.rank == 0:
        Path(a.result).write_text(json.dumps(_result(a, step, acc, train_s, reached, curve, every, state)))
    dist.destroy_process_group()


def _result(a: argparse.Namespace, step: int, acc: float, train_s: float, reached: Any, curve: list[Any],
            every: list[Any], state: Any) -> dict[str, Any]:
    import dqsgd.ddp
    from dqsgd.train.trainer import Trainer

    ratio = bits = None
    if isinstance(state, dqsgd.ddp.HookState):
        stats = state.compression_stats()
        ratio, bits = stats.ratio, stats.mean_bits
    elif isinstance(state, Trainer):
        ratio, bits = state.ledger.compression_ratio(), state.ledger.mean_bits()
    per_rank = [int(t) for t in every]
    return {"method": a.method, "steps": step, "final_acc": acc, "train_s": train_s, "reached": reached,
            "wire_bytes": sum(per_rank), "wire_bytes_per_rank": per_rank, "curve": curve,
            "payload_ratio": ratio, "mean_bits": bits}


# --- the orchestrator -------------------------------------------------------------------------------
def launch(net: Any, a: argparse.Namespace, method: str, result: Path) -> None:
    """Start every rank in its namespace; kill the whole run past ``--timeout`` or if one rank fails."""
    procs = []
    # TORCH_CPP_LOG_LEVEL: the namespaces have no name service, and c10d warns about it on every connect.
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE),
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    try:
        for r in range(a.workers):
            cmd = net.exec_prefix(r) + [sys.executable, str(Path(__file__).resolve()), "--rank", str(r), "--method", method,
                                        "--master", net.address(0), "--result", str(result), *_forward(a)]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        deadline = time.monotonic() + a.timeout + 30
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        time.sleep(0.5)
        codes = [p.poll() for p in procs]
        if codes != [0] * len(procs):
            raise RuntimeError(f"{method}: ranks ended with {codes} (None: still running at the deadline)")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # each rank was started in its own session
                p.wait(timeout=10)


def _forward(a: argparse.Namespace) -> list[str]:
    keys = ("workers", "dataset", "model", "steps", "target", "batch_size", "lr", "momentum", "eval_every",
            "eval_samples", "seed", "timeout", "kernel")
    return [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(a, k)))]


def link_s(row: dict[str, Any]) -> float:
    """Modelled network time: the busiest rank's bytes at the shaped rate (a lower bound on communication)."""
    from netns import rate_bits

    return 8 * max(row["wire_bytes_per_rank"]) / rate_bits(row["rate"])


def table(rows: list[dict[str, Any]], target: float) -> str:
    head = (f"{'rate':>8} {'method':>17} {'time to ' + format(target, '.0%'):>13} {'steps':>6} {'final acc':>9} "
            f"{'wire MB':>8} {'MB/step':>8} {'link s':>7} {'ms/step':>8} {'payload ratio':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        t = f"{r['reached']['train_s']:.1f} s" if r["reached"] else "—"
        ratio = f"{r['payload_ratio']:.2f}" if r.get("payload_ratio") else "—"
        lines.append(f"{r['rate']:>8} {r['method']:>17} {t:>13} {r['steps']:>6} {r['final_acc']:>9.4f} "
                     f"{r['wire_bytes'] / 1e6:>8.2f} {r['wire_bytes'] / 1e6 / r['steps']:>8.3f} {link_s(r):>7.1f} "
                     f"{1000 * r['train_s'] / r['steps']:>8.1f} {ratio:>13}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["rate"] for r in rows}, key=lambda x: rows.index(next(r for r in rows if r["rate"] == x)))
    fig, axes = plt.subplots(2, len(rates), figsize=(6 * len(rates), 8), squeeze=False)
    for j, rate in enumerate(rates):
        for r in (r for r in rows if r["rate"] == rate):
            xs = [c["train_s"] for c in r["curve"]]
            axes[0][j].plot(xs, [c["acc"] for c in r["curve"]], marker=".", label=r["method"])
            axes[1][j].plot(xs, [c["tx_bytes"] / 1e6 for c in r["curve"]], marker=".", label=r["method"])
        axes[0][j].axhline(target, color="grey", ls=":", lw=1)
        axes[0][j].set(title=f"{rate} per link", xlabel="training wall time (s)", ylabel="test accuracy")
        axes[1][j].set(xlabel="training wall time (s)", ylabel="MB sent by rank 0's interface")
        axes[0][j].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.rank is not None:
        run_rank(a)
        return 0
    sys.path.insert(0, str(HERE))
    from netns import NetworkUnavailable, PrivateNetwork

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = sorted(set(methods) - set(METHODS))
    if bad or a.workers < 2:
        print(f"bench network: unknown methods {bad} (choose from {METHODS}) or workers < 2", file=sys.stderr)
        return 2
    out = Path(a.out)
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
            for method in methods:
                res = Path(tmp, f"{rate}-{method}.json")
                start = time.perf_counter()
                launch(net, a, method, res)
                row = {"rate": rate, **json.loads(res.read_text()), "run_s": time.perf_counter() - start}
                rows.append(row)
                print(f"{rate} {method}: {row['steps']} steps, acc {row['final_acc']:.4f}, "
                      f"{row['wire_bytes'] / 1e6:.1f} MB on the wire, {row['run_s']:.0f} s in all", flush=True)
    print()
    print(table(rows, a.target))
    facts = {k: getattr(a, k) for k in ("workers", "dataset", "model", "steps", "target", "batch_size", "lr",
                                        "momentum", "eval_every", "eval_samples", "seed", "kernel")}
    (out / "network.json").write_text(json.dumps({"config": facts, "runs": rows}, indent=2))
    plot(rows, a.target, out / "network.png")
    print(f"\n{out / 'network.json'}, {out / 'network.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
