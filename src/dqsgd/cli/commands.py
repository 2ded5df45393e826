"""The ``dqsgd`` command line: train, compare, methods, configs, report, bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path

from dqsgd import __version__
from dqsgd.core.timeouts import TRAIN_COLLECTIVE_S, check_wait
from dqsgd.topology.registry import REGISTRY, run_topology
from dqsgd.train.config import (ConfigError, apply_overrides, build_experiment, check_selection, load_raw, resolve_device,
                                shipped_configs)


def _experiment(args: argparse.Namespace, method: str | None = None, only: list[str] | None = None):
    """The experiment of --config and --set (``method``: train's one method); ``only`` (compare
    --methods) is checked against the config's labels before the methods are built (which imports torch)."""
    raw, source = load_raw(args.config or "table1-mnist")
    if method is not None and isinstance(raw.get("methods", {}), dict):  # (not a table: refused below)
        tables = raw.get("methods", {})
        raw = {**raw, "methods": {method: dict(tables.get(method, {}))}}
    board = [f"train.tensorboard_dir={json.dumps(args.tensorboard)}"] if getattr(args, "tensorboard", None) else []
    raw = apply_overrides(raw, [*(args.set or []), *board])
    if only is not None and isinstance(raw.get("methods", {}), dict):
        check_selection(list(raw.get("methods", {})), only, source)
    return build_experiment(raw, source)


def cmd_methods(args: argparse.Namespace) -> int:
    from dqsgd.method.config import METHODS

    width = max(map(len, METHODS))
    for name, desc in METHODS.items():
        print(f"{name:<{width}}  {desc}")
    print(f"{'qsgd-<B>bit':<{width}}  QSGD with B bits (2..16), e.g. qsgd-4bit")
    print(f"{'qsgd-<B>bit-<coding>':<{width}}  ... and a coding (auto, elias, rans, ransx, zstd), e.g. qsgd-2bit-auto")
    return 0


def cmd_configs(args: argparse.Namespace) -> int:
    configs = sorted(shipped_configs().items())
    width = max(len(name) for name, _ in configs)
    for name, path in configs:
        first = path.read_text().splitlines()[0].lstrip("# ").strip()
        print(f"{name:<{width}}  {first}")
    print("\nRun a table1-* config with `dqsgd compare --config NAME`, a dq-* config with "
          "`dqsgd dq run --config NAME`; `--dry-run` checks either without running it.")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    only = args.methods.split(",") if args.methods else None
    exp = _experiment(args, only=only)
    out = Path(args.out or f"runs/{exp.train.name}")
    from dqsgd.experiments.compare import run_experiment
    from dqsgd.experiments.summary import format_table

    if args.dry_run:
        from dqsgd.cli.plan import compare_plan

        print("\n".join(compare_plan(exp, out, args.resume, only, args.overwrite)))
        return 0
    start = time.perf_counter()
    sets = "".join(f" --set {shlex.quote(x)}" for x in args.set or [])
    args.resume_hint = (f"dqsgd compare --config {shlex.quote(args.config or 'table1-mnist')}{sets} "
                        f"--out {shlex.quote(str(out))} --resume")
    rows = run_experiment(exp, out, progress=not args.quiet, resume=args.resume, only=only, overwrite=args.overwrite)
    t = exp.train
    print(f"\n{t.name}: {t.dataset} / {t.model}, W = {t.workers}, {t.steps} steps, seeds {list(t.seeds)}")
    print(format_table(rows))
    print(f"\nwall time {time.perf_counter() - start:.0f} s; report: {out / 'report.md'}; tables: {out / 'summary.csv'}")
    _say_if_no_figures()
    return 0


def _say_if_no_figures() -> None:
    from dqsgd.experiments.report import FIGURES_MISSING, figures_available

    if not figures_available():
        print(f"dqsgd: note: {FIGURES_MISSING}", file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> int:
    if (why := check_wait("--timeout", args.timeout)) is not None:
        raise ConfigError(why)
    if args.max_restarts and args.transport != "torch":
        raise ConfigError("--max-restarts restarts distributed processes: it needs --transport torch")
    exp, seed = _train_experiment(args)
    topology = run_topology(args.topology or exp.train.topology, processes=args.transport == "torch")
    exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, topology=topology))
    entry = exp.methods[0]
    from dqsgd.experiments.compare import load_data_for  # torch: only once the arguments are valid
    from dqsgd.train.runner import default_train_dir, run_one

    if args.dry_run:
        from dqsgd.cli.plan import train_plan

        print("\n".join(train_plan(exp, entry, seed, args)))
        return 0
    if args.transport == "torch":
        from dqsgd.cli.launch import train_distributed

        return train_distributed(exp, entry, seed, args)
    out = Path(args.resume or args.out or default_train_dir(exp.train.name, entry.label, seed))
    args.resume_hint = f"dqsgd train --resume {shlex.quote(str(out))}"
    device = resolve_device(exp.train.device)
    from dqsgd.train.rundir import RunFinished

    try:
        s = run_one(exp.train, entry, load_data_for(exp), seed, out, resume=bool(args.resume),
                    progress=not args.quiet, overwrite=args.overwrite, device=device)
    except RunFinished as e:  # --resume of a finished run: reported, left untouched
        print(f"dqsgd: {e}")
        return 0
    from dqsgd.train.progress import result_line

    if s.already_finished:
        print(f"dqsgd: {RunFinished(out, s)}")
    print(f"{result_line(s)}; metrics in {out}")
    return 0


def _train_experiment(args: argparse.Namespace):
    """The experiment and seed of ``dqsgd train``: from --config/--method, or with ``--resume RUN_DIR``
    and no --config, from the run's own ``config.json`` (with any --set applied on top; the run
    refuses to continue if they change a compared key)."""
    if args.resume and args.config is None:
        from dqsgd.train.rundir import experiment_of_run

        raw, label, seed = experiment_of_run(Path(args.resume))
        if args.method not in (None, label):
            raise ConfigError(f"--resume {args.resume} is a run of method {label!r}, not {args.method!r}")
        exp = build_experiment(apply_overrides(raw, args.set or []), str(Path(args.resume) / "config.json"))
        return exp, args.seed if args.seed is not None else seed
    if args.method is None:
        raise ConfigError("--method is required (except with --resume RUN_DIR, which reads the run's config.json)")
    exp = _experiment(args, method=args.method)
    return exp, args.seed if args.seed is not None else exp.train.seeds[0]


def cmd_report(args: argparse.Namespace) -> int:
    from dqsgd.train.reader import run_dirs

    root = Path(args.run_dir)
    if not root.is_dir() or not run_dirs(root):  # said before torch is imported
        raise FileNotFoundError(f"{root}: no runs (no */seed*/metrics.jsonl with config.json)")
    from dqsgd.experiments.report import build_report
    from dqsgd.experiments.summary import format_table, write_tables

    rows = write_tables(root)
    print(format_table(rows))
    print(f"report: {build_report(root)}")
    _say_if_no_figures()
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dqsgd", description="Dynamic Quantized SGD and its baselines, with measured bytes.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def add_cfg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", help="shipped config name or a TOML path (default: table1-mnist; "
                        "with train --resume: the run's own config.json)")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="dotted override, e.g. train.steps=200 or methods.dqsgd.target_bits=4 (repeatable)")
        sp.add_argument("--out", help="output directory (default: compare: runs/<train.name>; "
                        "train: runs/train/<train.name>/<method>/seed<k>)")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")
        sp.add_argument("--tensorboard", metavar="DIR",
                        help="also log each run to TensorBoard under DIR/LABEL/seedK (= --set train.tensorboard_dir=DIR)")
        sp.add_argument("--overwrite", action="store_true",
                        help="replace the run(s) already in the output directory (default: refuse)")
        sp.add_argument("--dry-run", action="store_true",
                        help="check the config, overrides, data, output directory and resume target, print "
                             "the plan, and stop (nothing is trained or written)")

    sp = sub.add_parser("train", help="train one method")
    add_cfg(sp)
    sp.add_argument("--method", help="method name (see `dqsgd methods`) or a label in the config (required "
                    "unless --resume)")
    sp.add_argument("--seed", type=int)
    sp.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    sp.add_argument("--max-restarts", type=int, default=0,
                    help="--transport torch without torchrun: restart the processes from the last checkpoints "
                         "this many times after a failure (under torchrun: torchrun's own --max-restarts)")
    sp.add_argument("--transport", choices=["sim", "torch"], default="sim")
    sp.add_argument("--topology", choices=REGISTRY,  # the registry itself: a topology registered later is a choice
                    help="default: train.topology, else sharded (--transport torch) or ps (sim)")
    sp.add_argument("--workers", type=int, help="with --transport torch outside torchrun: processes to start")
    sp.add_argument("--timeout", type=float, default=TRAIN_COLLECTIVE_S,
                    help="seconds before a collective gives up (torch transport)")
    sp.set_defaults(func=cmd_train)

    sp = sub.add_parser("compare", help="compare the methods of a config on the same data and seeds")
    add_cfg(sp)
    sp.add_argument("--methods", help="comma-separated subset of the config's method labels")
    sp.add_argument("--resume", action="store_true",
                    help="keep finished runs, continue unfinished ones from their checkpoints (train.checkpoint_every), "
                         "start the rest")
    sp.set_defaults(func=cmd_compare)

    from dqsgd.dq import cli as dq_cli

    sp = sub.add_parser("dq", help="Double Quantization (AsyLPG family): `dqsgd dq run|list ...`",
                        description=dq_cli.DESCRIPTION)
    dq_cli.add_dq_arguments(sp)
    sp.set_defaults(func=dq_cli.run_command)
    from dqsgd.cli.bench.parser import add_bench_parser

    add_bench_parser(sub)
    sub.add_parser("methods", help="list the registered methods").set_defaults(func=cmd_methods)
    sub.add_parser("configs", help="list the shipped configs").set_defaults(func=cmd_configs)
    sp = sub.add_parser("report", help="rebuild tables, report and plots of RUN_DIR from its JSONL files")
    sp.add_argument("run_dir")
    sp.set_defaults(func=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``dqsgd`` command; its exit status. A reader that closes the pipe early (``dqsgd configs |
    head -1``) ends it quietly with 141 (128 + SIGPIPE, as a program the signal stopped)."""
    try:
        rc = _main(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
        return rc
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141


def _main(argv: list[str] | None) -> int:
    from dqsgd.core.cpus import prepare_command_process
    from dqsgd.core.errors import Interrupted

    prepare_command_process()  # idle OpenMP threads sleep: set before torch loads (dqsgd.core.cpus)

    args = parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        raise
    except Interrupted as e:  # the run stopped cleanly between two steps
        hint = getattr(args, "resume_hint", None)
        print(f"dqsgd: {e}" + (f"; continue with: {hint}" if e.saved and hint else ""), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("dqsgd: interrupted", file=sys.stderr)
        return 130
    # Expected user and environment errors get one line; anything else (a bug) keeps its traceback.
    except (ConfigError, ValueError, OSError) as e:
        print(f"dqsgd: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
