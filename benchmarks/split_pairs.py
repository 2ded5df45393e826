"""The widths of both legs that budgeted DQSGD chooses on topology sharded, with the budgeted downlink
(``downlink_bits = "auto"``) and with the explicit 8-bit one, at the same budget.

    PYTHONPATH=src python benchmarks/split_pairs.py [--method dqsgd] [--workers 4] [--steps 30] [--codings fixed,auto]
        [--target-bits T] [--downlink-target-bits D] [--feedback]

Trains the shipped MLP on the synthetic dataset in the simulation (the trainer, the real payloads,
the ledger) and prints, for each downlink setting, the (u, v) pairs of every step, how often each
occurred, the bytes one worker sent and received per step (both legs, as the ledger counts them),
the budget spent, and the mean over the steps of the pair's bound Q(u, v) = 1/(W·s_u²) + 1/s_v²
(docs/topologies.md, "One budget for both legs"). ``--codings``: run the "auto" split once per downlink
coding (``train.downlink_coding``; default: the method's own). ``--downlink-target-bits`` and
``--feedback`` set ``train.downlink_target_bits`` and ``train.downlink_feedback`` of the "auto" runs;
each run also prints the budget spent and fp32's bits (32 up + 32 down per coordinate) over its own.
"""

from __future__ import annotations

import argparse
import collections

from dqsgd import theory
from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.train.config import MethodEntry, TrainConfig
from dqsgd.train.trainer import Trainer


def run(method: str, workers: int, steps: int, downlink: int | str, coding: str = "", target: float = 0.0,
        down_target: float = 0.0, feedback: bool = False) -> dict[str, object]:
    auto = downlink == "auto"
    cfg = TrainConfig(name="split", dataset="synthetic", model="mlp", workers=workers, steps=steps, batch_size=16,
                      lr=0.05, topology="sharded", eval_every=10**6, coded_every=0, threads=1, downlink_bits=downlink,
                      downlink_coding=coding, downlink_target_bits=down_target if auto else 0.0,
                      downlink_feedback=feedback and auto)
    options = {"target_bits": target} if target else {}
    tr = Trainer(cfg, MethodEntry(method, method_config(method, **options)), load_dataset("synthetic"), 0)
    pairs = []
    for _ in range(steps):
        pairs.append((tr.state.bits, tr.step_runner.protocol.down_width(tr.state.policy)))
        tr.step()
    led = tr.ledger
    q = [theory.two_stage_quantization_term([1.0], [u], [1.0], workers, v) for u, v in pairs]
    return {"pairs": collections.Counter(pairs).most_common(), "bytes_per_step": (led.up_bytes + led.down_bytes) / workers / steps,
            "spent": led.spent_bits() if led.both_legs else led.spent_bits() + 8 * sum(r.down_bytes for r in led.records),
            "budget": led.budget_bits, "mean_q": sum(q) / len(q), "numel": tr.numel,
            "fp32_ratio": 64 * tr.numel * steps / max(1, led.spent_bits()) if led.both_legs else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="dqsgd")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--codings", default="", help="comma-separated downlink codings of the 'auto' runs")
    ap.add_argument("--target-bits", type=float, default=0.0, help="the method's target_bits (0: its default)")
    ap.add_argument("--downlink-target-bits", type=float, default=0.0)
    ap.add_argument("--feedback", action="store_true", help="error-fed downlink in the 'auto' runs")
    a = ap.parse_args()
    runs = [(8, "")] + [("auto", c) for c in (a.codings.split(",") if a.codings else [""])]
    for downlink, coding in runs:
        r = run(a.method, a.workers, a.steps, downlink, coding, a.target_bits, a.downlink_target_bits, a.feedback)
        what = f"downlink {downlink!r}" + (f", coding {coding}" if coding else "")
        print(f"{a.method}, W = {a.workers}, d = {r['numel']}, {what}: pairs {r['pairs']}")
        print(f"  bytes per worker and step (both legs) {r['bytes_per_step']:.0f}; both-leg bits spent "
              f"{r['spent']}" + (f" of {r['budget']} ({r['spent'] / r['budget']:.4f}); fp32 / both legs "
                                  f"{r['fp32_ratio']:.1f}" if downlink == "auto" else " (its budget: the uplink's)")
              + f"; mean Q(u, v) {r['mean_q']:.3g}")


if __name__ == "__main__":
    main()
