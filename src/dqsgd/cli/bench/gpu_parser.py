"""``dqsgd bench gpu``'s argparse wiring, importable without torch (the command is :mod:`dqsgd.cli.bench.gpu`)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_gpu_parser"]


def add_gpu_parser(bsub: Any) -> None:
    """``bench gpu`` under an argparse ``bench`` sub-parser set (runs :mod:`dqsgd.cli.bench.gpu`)."""
    from dqsgd.cli.bench.choices import int_list

    g = bsub.add_parser("gpu", help="the GPU path in one run: correctness, codec speed, DDP loopback, link model, "
                                    "host time; gpu.json, gpu.md",
                        description="Measure the GPU path: device correctness against the CPU kernels, codec speed "
                                    "as a ratio to copy_ and in GB/s, loopback DDP step time per hook (none, fp16, "
                                    "bf16, PowerSGD ranks 1 and 4, qsgd-4bit, dqsgd), the step modelled on a "
                                    "10/25/100 Gbit/s link, host time per bucket, recompilations, simulation steps/s. "
                                    "Exits 2 without a GPU.")
    g.add_argument("--out", default="runs/bench/gpu",
                   help="directory for gpu.json and gpu.md (default: runs/bench/gpu)")
    g.add_argument("--sizes", type=int_list, default=[1_000_000, 25_000_000, 100_000_000],
                   help="codec sizes (default: 1e6,25e6,1e8)")
    g.add_argument("--bits", type=int_list, default=[1, 2, 4, 8], help="codec widths (default: 1,2,4,8)")
    g.add_argument("--torch-sizes", type=int_list, default=[25_000_000],
                   help="sizes at which the torch-ops codec is timed too (each compiles anew) (default: 25e6)")
    g.add_argument("--torch-bits", type=int_list, default=[4],
                   help="widths at which the torch-ops codec is timed (each compiles anew) (default: 4)")
    g.add_argument("--rounds", type=int, default=5, help="interleaved codec timing rounds (default: 5)")
    g.add_argument("--check-n", type=int, default=1_000_003, help="elements of the correctness checks")
    g.add_argument("--models", type=lambda t: [v for v in t.split(",") if v], default=["resnet18", "transformer"],
                   help="DDP loopback models: resnet18, transformer (default: both)")
    g.add_argument("--worlds", type=int_list, default=[4, 8], help="virtual ranks of the loopback (default: 4,8)")
    g.add_argument("--ddp-rounds", type=int, default=5, help="interleaved DDP rounds (default: 5)")
    g.add_argument("--ddp-steps", type=int, default=3, help="steps per hook per round (default: 3)")
    g.add_argument("--batch", type=int, default=128, help="ResNet-18 batch (the transformer takes batch/8 sequences)")
    g.add_argument("--bucket-n", type=lambda t: int(float(t)), default=6_553_600,
                   help="elements of the bucket whose exchange's host time is measured (default: 6553600 = "
                        "25 MB of fp32, DDP's bucket)")
    g.add_argument("--host-rounds", type=int, default=10, help="timed exchanges per W for the host time (default: 10)")
    g.add_argument("--sim-models", type=lambda t: [v for v in t.split(",") if v], default=["cnn", "resnet18"],
                   help="simulation models (cnn = LeNet-5) (default: cnn,resnet18)")
    g.add_argument("--sim-steps", type=int, default=10, help="timed simulation steps per method (default: 10)")
    g.add_argument("--device", choices=["auto", "cpu"], default="auto", help=argparse.SUPPRESS)  # tests: CPU, titled so
    g.set_defaults(func=lambda a: __import__("dqsgd.cli.bench.gpu", fromlist=["bench_gpu"]).bench_gpu(a))
