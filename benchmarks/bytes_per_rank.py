"""Bytes per rank per step of the three topologies, measured in the simulation (no network).

    python benchmarks/bytes_per_rank.py --out results/bytes-per-rank [--bits 4] [--steps 2]

For W = 2, 4, 8, 16 and each topology (allgather, ps, sharded) this trains the shipped CNN on MNIST
for ``--steps`` steps with QSGD at ``--bits`` bits (the trainer, the real payloads, the ledger) and
reports, per step:

* ``rank_bytes``: the busiest rank's link bytes, uplink + downlink phase, each phase the larger of
  what the rank sends and receives (padding included, a rank's message to itself excluded);
* ``message_bytes``: one worker's uplink message plus the downlink it receives (the per-message
  convention of the ratios: it counts the part of the vector a rank serves itself too).

The sharded downlink uses ``--down-bits`` (default 8); ps sends the average in fp32, as the paper's
server does. The table is printed; ``bytes_per_rank.csv`` and ``bytes_per_rank.png`` go to --out.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.trainer import Trainer

TOPOLOGIES = ("allgather", "ps", "sharded")


def measure(data, workers: int, topology: str, bits: int, down_bits: int, steps: int) -> dict[str, float]:
    cfg = TrainConfig(name="bytes", dataset="mnist", model="cnn", workers=workers, steps=steps, batch_size=32,
                      lr=0.02, topology=topology, downlink_bits=down_bits, threads=1)
    tr = Trainer(cfg, MethodEntry(f"qsgd-{bits}bit", method_config("qsgd", bits=bits, kernel="fused")), data, 0)
    for _ in range(steps):
        tr.step()
    recs = tr.ledger.records
    rank = sum(max(a + b for a, b in zip(r.rank_up, r.rank_down)) for r in recs) / len(recs)
    msg = sum(max(r.up_bytes) + r.down_bytes for r in recs) / len(recs)
    return {"workers": workers, "topology": topology, "numel": tr.numel, "rank_bytes": rank, "message_bytes": msg,
            "fp32_allreduce_bytes": 2 * (workers - 1) / workers * 4 * tr.numel}


def plot(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ws = sorted({int(r["workers"]) for r in rows})
    for topo in TOPOLOGIES:
        ax.plot(ws, [next(r["rank_bytes"] for r in rows if r["topology"] == topo and r["workers"] == w) / 1e3
                     for w in ws], marker="o", label=topo)
    ax.plot(ws, [next(r["fp32_allreduce_bytes"] for r in rows if r["workers"] == w) / 1e3 for w in ws],
            linestyle="--", color="gray", label="fp32 ring all-reduce")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ws, [str(w) for w in ws])
    ax.set_xlabel("W (workers = ranks)")
    ax.set_ylabel("busiest rank's link bytes per step (kB)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/bytes-per-rank")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--down-bits", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--workers", default="2,4,8,16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = load_dataset("mnist")
    rows = [measure(data, int(w), topo, args.bits, args.down_bits, args.steps)
            for w in args.workers.split(",") for topo in TOPOLOGIES]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bytes_per_rank.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    plot(rows, out / "bytes_per_rank.png")
    print(f"CNN, d = {int(rows[0]['numel'])}, QSGD {args.bits} bits up; sharded downlink {args.down_bits} bits, "
          f"ps downlink fp32; mean over {args.steps} steps")
    print(f"{'W':>3} {'topology':>10} {'busiest rank B/step':>20} {'message B/step':>15} {'fp32 all-reduce':>16}")
    for r in rows:
        print(f"{int(r['workers']):>3} {r['topology']:>10} {r['rank_bytes']:>20,.0f} {r['message_bytes']:>15,.0f} "
              f"{r['fp32_allreduce_bytes']:>16,.0f}")
    ws = sorted({int(r["workers"]) for r in rows})
    sh = {int(r["workers"]): r for r in rows if r["topology"] == "sharded"}
    lo, hi = sh[ws[0]], sh[ws[-1]]
    print(f"sharded, W = {ws[-1]} vs W = {ws[0]}: busiest rank x{hi['rank_bytes'] / lo['rank_bytes']:.3f} "
          f"(2(W-1)/W predicts x{(ws[-1] - 1) / ws[-1] / ((ws[0] - 1) / ws[0]):.3f}), "
          f"message bytes x{hi['message_bytes'] / lo['message_bytes']:.3f}")
    print(f"wrote {out / 'bytes_per_rank.csv'} and {out / 'bytes_per_rank.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
