"""The ``dqsgd bench`` sub-commands' argparse wiring, importable without torch or numba.

The benchmarks load only when one runs: ``dqsgd --help`` and ``dqsgd bench --help`` parse without
importing the compiled kernels. ``step`` runs :mod:`dqsgd.cli.bench.common` and ``hook`` :mod:`dqsgd.cli.bench.hook`
(both in the package). ``codec``, ``compressors`` and ``network`` run scripts of the source
checkout's ``benchmarks/`` folder (they time internals, or need root); where that folder is not
found, as in an installed wheel, they say so and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from dqsgd.cli.bench.choices import HOOKS, MODELS, int_list
from dqsgd.core.timeouts import BENCH_COLLECTIVE_S

BENCHMARKS = Path(__file__).resolve().parents[4] / "benchmarks"  # in a source checkout: <repo>/benchmarks


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    """The bench function ``dqsgd.cli.bench.common.<name>`` as a CLI command (exit status 0), imported when it runs."""
    def run(args: argparse.Namespace) -> int:
        from dqsgd.cli.bench import common as bench

        getattr(bench, name)(args)
        return 0
    return run


def load_script(relpath: str) -> ModuleType | None:
    """The script ``benchmarks/<relpath>`` of the source checkout, imported once; None where it is not found."""
    path = BENCHMARKS / relpath
    if not path.is_file():
        return None
    name = "_dqsgd_benchmarks." + relpath.removesuffix(".py").replace("/", ".")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def _checkout_command(command: str, relpath: str, call: Callable[[ModuleType, argparse.Namespace], Any]
                      ) -> Callable[[argparse.Namespace], int]:
    """``dqsgd bench <command>`` as running ``benchmarks/<relpath>``: status 2, and why, where it is missing."""
    def run(args: argparse.Namespace) -> int:
        module = load_script(relpath)
        if module is None:
            print(f"dqsgd bench {command}: needs a source checkout of dqsgd: {BENCHMARKS / relpath} not found "
                  "(the installed package does not ship benchmarks/); run it from a clone of the repository",
                  file=sys.stderr)
            return 2
        status = call(module, args)
        return status if isinstance(status, int) else 0
    return run


def _common(p: argparse.ArgumentParser, repeats: int, threads: int, out: str) -> None:
    p.add_argument("--repeats", type=int, default=repeats,
                   help=f"interleaved timing rounds; the best round of each is kept (default: {repeats})")
    p.add_argument("--threads", type=int, default=threads,
                   help=f"torch and codec threads (torch.set_num_threads) (default: {threads})")
    p.add_argument("--out", default=out, help=f"JSON file for the results (default: {out})")


def add_bench_parser(sub: Any) -> None:
    """Add ``bench codec|step|compressors|hook|fsdp|gpu|network`` to an argparse sub-parsers object."""
    bench = sub.add_parser("bench", help="benchmarks: codec (throughput), step (training-step overhead), "
                           "compressors (vs PyTorch's DDP hooks), hook (DDP step time per comm hook), fsdp (FSDP2 "
                           "reduce-scatter), gpu (the GPU path in one run), network (tc-shaped links); results under "
                           "runs/bench/",
                           description="Benchmarks. Speeds are ratios against out.copy_(g) (or plain SGD) in the "
                                       "same process, so other jobs on the machine cancel out. Each prints a table "
                                       "and writes JSON (--out, by default under runs/bench/).")
    bsub = bench.add_subparsers(dest="bench", required=True)
    c = bsub.add_parser("codec", help="encode/decode GB/s vs copy_, coded bits vs entropy",
                        description="Codec throughput (GB/s of fp32 input) against a copy in the same run, "
                                    "and the coded bits per coordinate against the levels' entropy.")
    c.add_argument("--sizes", type=int_list, default=[1_000_000, 25_000_000],
                   help="gradient sizes (coordinates), comma-separated, e.g. 1e6,25e6 (default: 1000000,25000000)")
    c.add_argument("--bits", type=int_list, default=[1, 2, 4, 6, 8, 16],
                   help="bit widths to time, comma-separated (default: 1,2,4,6,8,16)")
    c.add_argument("--torch-repeats", type=int, default=2,
                   help="timing rounds of the slower torch-ops reference path (default: 2)")
    c.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the device codec rows run (auto: CUDA if available, else the CPU)")
    c.add_argument("--device-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="force torch.compile on (or off) for the device rows (default: on for CUDA only)")
    c.add_argument("--rans-only", action="store_true",
                   help="time only the rANS coders (RANS, RANSX): ns per code of encode and decode at each size "
                        "and width of 2..16 bits")
    _common(c, 5, 2, "runs/bench/codec.json")
    c.set_defaults(func=_checkout_command("codec", "bench_codec.py", lambda m, a: m.bench_codec(a)))
    s = bsub.add_parser("step", help="simulated Trainer.step() of dqsgd vs plain SGD; --contention: a training "
                        "job's CPU and wall time quiet and beside busy loops",
                        description="One simulated training step (all W workers) of dqsgd, torch and fused "
                                    "kernels, against plain SGD on the same config. With --contention instead: a "
                                    "short `dqsgd train` job in a child process, quiet and then beside --busy busy "
                                    "loops; its CPU time (user + sys) and wall time, and their ratios.")
    s.add_argument("--config", default="table1-mnist",
                   help="shipped config name or TOML path: model, data and W (default: table1-mnist)")
    s.add_argument("--steps", type=int, default=20, help="timed steps per method; with --contention the job's "
                   "training steps (default: 20)")
    s.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, caches) (default: 3)")
    s.add_argument("--threads", type=int, default=1, help="torch intra-op threads; with --contention the job's "
                   "train.threads, 0 = PyTorch's default (default: 1)")
    s.add_argument("--out", help="JSON file for the results (default: runs/bench/step.json; with --contention "
                   "runs/bench/contention.json)")
    _add_contention(s)
    s.set_defaults(func=_bench_step)
    k = bsub.add_parser("compressors", help="dqsgd's methods vs PyTorch's DDP compression hooks",
                        description="Compress one real gradient with dqsgd's methods and PyTorch's DDP "
                                    "compression hooks: time, bytes and relative error.")
    k.add_argument("--model", default="cnn", help="model whose gradient is compressed (default: cnn)")
    k.add_argument("--dataset", default="mnist", help="dataset of the batch that gives the gradient (default: mnist)")
    k.add_argument("--batch", type=int, default=32, help="batch size of that gradient (default: 32)")
    _common(k, 5, 1, "runs/bench/compressors.json")
    k.set_defaults(func=_checkout_command("compressors", "bench_compressors.py", lambda m, a: m.bench_compressors(a)))
    add_hook_parser(bsub)  # dqsgd bench hook
    from dqsgd.cli.bench.gpu_parser import add_gpu_parser  # dqsgd bench gpu (its parser, torch-free like this one)

    add_gpu_parser(bsub)
    add_fsdp_parser(bsub)  # dqsgd bench fsdp
    n = bsub.add_parser("network", help="4 network namespaces with tc-shaped links (root, source checkout); "
                                        "`dqsgd bench network --help` lists its own options", add_help=False,
                        prefix_chars="+")  # no options of its own: every "-..." word goes to the script
    n.add_argument("rest", nargs=argparse.REMAINDER, help="options of benchmarks/network/bench_network.py")
    n.set_defaults(func=_checkout_command("network", "network/bench_network.py", lambda m, a: int(m.main(a.rest) or 0)))


def _add_contention(s: argparse.ArgumentParser) -> None:
    """``bench step``'s ``--contention`` options (:mod:`dqsgd.cli.bench.contention`)."""
    s.add_argument("--contention", action="store_true", help="measure a training job quiet and beside busy loops")
    s.add_argument("--method", default="sgd", help="--contention: the method the job trains (default: sgd)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="--contention: a dotted override for the "
                   "job, as `dqsgd train --set` (repeatable)")
    s.add_argument("--busy", type=int, default=2, help="--contention: busy loops beside the loaded run (default: 2)")
    s.add_argument("--repeats", type=int, default=1, help="--contention: quiet/loaded pairs, alternating; the "
                   "medians are compared (default: 1)")
    s.add_argument("--wait-policy", choices=["passive", "openmp-default"], default="passive",
                   help="--contention: the job's OMP_WAIT_POLICY: passive (what the dqsgd command sets) or "
                        "openmp-default (unset: idle OpenMP threads spin first; the old behaviour) (default: passive)")
    s.add_argument("--deadline", type=float, default=1800.0, help="--contention: seconds one job may take")


def _bench_step(args: argparse.Namespace) -> int:
    """``bench step``: the step benchmark, or with ``--contention`` the contention one."""
    if args.contention:
        from dqsgd.cli.bench.contention import bench_contention

        args.out = "runs/bench/contention.json" if args.out is None else args.out
        bench_contention(args)
        return 0
    args.out = "runs/bench/step.json" if args.out is None else args.out
    return _command("bench_step")(args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``argv`` (``["bench", <command>, ...]``) parsed by the ``dqsgd bench`` sub-commands under a bare parser."""
    parser = argparse.ArgumentParser(prog="dqsgd")
    add_bench_parser(parser.add_subparsers(dest="cmd", required=True))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """``benchmarks/bench_*.py``: the same sub-commands under a bare ``dqsgd`` parser; the exit status."""
    args = parse_args(argv)
    return int(args.func(args) or 0)


def add_hook_parser(bsub: Any) -> None:
    """``bench hook`` under an argparse ``bench`` sub-parser set."""
    h = bsub.add_parser("hook", help="DDP step time per comm hook (fp16, PowerSGD, dqsgd) / no hook")
    h.add_argument("--model", default="mlp,cnn", help=f"comma-separated, from {', '.join(MODELS)} "
                   "(resnet18 is slow on CPU)")
    h.add_argument("--hooks", default=",".join(HOOKS[1:]), help=f"comma-separated, from {', '.join(HOOKS[1:])}, "
                   "or '<method> <sharded|allgather>' for any registered method (e.g. 'dqsgd-coded sharded'); "
                   "no hook always runs: it is the reference")
    h.add_argument("--ratios", default="", help="comma-separated 'a/b' pairs of hooks that run: also report "
                   "step a / step b per round (e.g. 'dqsgd-coded sharded/qsgd-2bit sharded')")
    h.add_argument("--batch", type=int, default=128, help="batch per rank (CIFAR-shaped synthetic data)")
    h.add_argument("--steps", type=int, default=5, help="timed steps per hook per round")
    h.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median and range reported)")
    h.add_argument("--world", type=int, default=2, help="gloo processes on CPU")
    _process_options(h, 3, "untimed steps per hook first", 3600.0, "runs/bench/hook.json")
    h.set_defaults(func=lambda a: (__import__("dqsgd.cli.bench.hook", fromlist=["bench_hook"]).bench_hook(a), 0)[1])


def _process_options(p: Any, warmup: int, warmup_help: str, deadline: float, out: str) -> None:
    """The options of a benchmark that starts gloo processes: warm-up, threads, timeouts, output file."""
    p.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--timeout", type=float, default=BENCH_COLLECTIVE_S, help="seconds any collective may take")
    p.add_argument("--deadline", type=float, default=deadline, help="seconds the whole benchmark may take")
    p.add_argument("--out", default=out, help=f"JSON file for the results, '' for none (default: {out})")


def add_fsdp_parser(bsub: Any) -> None:
    """``bench fsdp`` (:mod:`dqsgd.cli.bench.fsdp`) under an argparse ``bench`` sub-parser set."""
    f = bsub.add_parser("fsdp", help="FSDP2 gradient bytes and step time: dqsgd's reduce-scatter vs FSDP's own")
    f.add_argument("--methods", default="qsgd-4bit,dqsgd", help="comma-separated dqsgd methods")
    f.add_argument("--sizes", default="1024,1024,1024,1024", help="MLP widths (each Linear an FSDP unit)")
    f.add_argument("--world", type=int, default=4, help="gloo processes on CPU")
    f.add_argument("--batch", type=int, default=64, help="batch per rank (synthetic)")
    f.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    f.add_argument("--rates", default="", help="comma-separated link rates, e.g. 100mbit,1gbit: run the ranks in "
                   "network namespaces on tc-shaped links (root, a source checkout; as `dqsgd bench network`); "
                   "default: loopback")
    f.add_argument("--repeats", type=int, default=2, help="runs per rate with --rates (median and range reported)")
    f.add_argument("--nodes", type=int, default=1, help="HSDP: the ranks as NODES x world/NODES (a 2-D mesh; the "
                   "variant rep:<method> compresses the cross-node leg); with --rates the links between nodes get "
                   "the rate and those inside a node --node-rate")
    f.add_argument("--node-rate", default="10gbit", help="with --rates and --nodes: the rate of the links inside a "
                   "node (default: 10gbit)")
    _process_options(f, 2, "untimed steps per variant first (at least 1)", 1800.0, "runs/bench/fsdp.json")
    f.set_defaults(func=_bench_fsdp)


def _bench_fsdp(args: argparse.Namespace) -> int:
    """``bench fsdp``; with ``--rates``, given the checkout's ``benchmarks/network/netns.py``."""
    from dqsgd.cli.bench.fsdp import bench_fsdp

    if args.nodes < 1 or args.world % args.nodes:
        print(f"dqsgd bench fsdp: --nodes {args.nodes} does not divide --world {args.world} ranks into nodes",
              file=sys.stderr)
        return 2
    if not args.rates:
        bench_fsdp(args)
        return 0
    return _checkout_command("fsdp", "network/netns.py", lambda m, a: bench_fsdp(a, m))(args)
