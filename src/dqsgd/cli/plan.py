"""``--dry-run`` of ``dqsgd train`` and ``dqsgd compare`` (``dqsgd dq run``: :func:`dqsgd.dq.cli.dq_plan`): resolve and check
everything a run would use, print the plan, and stop before training or writing anything.

What is checked is what the real command checks before its first step, through the same functions:
the config and every ``--set`` override, the method(s), the device, the data (loaded, so a missing or
damaged dataset is refused here), the model (built once for its parameter count), the output
directory (a file, a directory that already holds a run without ``--resume``/``--overwrite``) and
the resume target (its ``config.json`` and that the resumed run has the same resolved config). For
``--transport torch`` also the process count against ``train.workers`` (under torchrun: its
WORLD_SIZE), ``--max-restarts`` and checkpoints; no process group is started.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dqsgd.dq.cli import DONE
from dqsgd.topology.registry import run_topology
from dqsgd.train.config import ExperimentConfig, MethodEntry, resolve_downlink



def _setting(exp: ExperimentConfig, data: Any, device: Any) -> str:
    t = exp.train
    return (f"  setting: {t.dataset} ({len(data.train.y)} train / {len(data.test.y)} test samples) / {t.model} "
            f"({_parameters(exp, data)} parameters), W = {t.workers}, {t.steps} steps, batch {t.batch_size} "
            f"per worker, device {device}")


def _parameters(exp: ExperimentConfig, data: Any) -> int:
    from dqsgd.models import build_model

    return sum(p.numel() for p in build_model(exp.train.model, data).parameters() if p.requires_grad)


def train_plan(exp: ExperimentConfig, entry: MethodEntry, seed: int, args: argparse.Namespace) -> list[str]:
    """The plan of ``dqsgd train`` (simulated or ``--transport torch``)."""
    from dqsgd.experiments.compare import load_data_for
    from dqsgd.train.config import resolve_device
    from dqsgd.train.rundir import check_run_dir, check_same_run, data_fingerprint, resolved_of_run
    from dqsgd.train.runner import default_train_dir

    lines = [f"dry run: train {entry.label} (config {exp.source or 'from the command line'}), seed {seed}"]
    if args.transport == "torch":
        from dqsgd.cli.launch import check_distributed, under_torchrun

        exp, out_s, restarts, world = check_distributed(exp, entry, seed, args)
        out, device = Path(out_s), "cpu or cuda:LOCAL_RANK (per process)"
        how = "torchrun" if under_torchrun() else f"{world} local processes on 127.0.0.1"
        lines.append(f"  transport: torch, {how}, topology {run_topology(exp.train.topology, processes=True)}, "
                     f"collective timeout {args.timeout:g} s" + (f", up to {restarts} restarts" if restarts else ""))
    else:
        out = Path(args.resume or args.out or default_train_dir(exp.train.name, entry.label, seed))
        device = resolve_device(exp.train.device)
        lines.append(f"  transport: simulated in this process, topology {run_topology(exp.train.topology, processes=False)}")
    _check_downlink(exp, entry, processes=args.transport == "torch")
    data = load_data_for(exp)
    lines.append(_setting(exp, data, device))
    action = check_run_dir(out, bool(args.resume), bool(args.overwrite))
    if args.resume:
        check_same_run(out, resolved_of_run(exp.train, entry, seed, data_fingerprint(data)))
    lines.append(f"  output: {out} ({_ACTIONS[action]})")
    return [*lines, DONE]


def _check_downlink(exp: ExperimentConfig, entry: MethodEntry, processes: bool) -> None:
    """The downlink keys as the run resolves them on its topology (its transport's default where none is set:
    ``processes``: a run over processes)."""
    from dqsgd.core.config_file import ConfigError

    cfg = entry.train_config(exp.train)
    try:
        resolve_downlink(cfg, entry.config, run_topology(cfg.topology, processes))
    except ValueError as e:
        raise ConfigError(f"methods.{entry.label}: {e}") from None


_ACTIONS = {"new": "a new run", "resume": "continue from its newest checkpoint, same config",
            "replace": "replace the run there (--overwrite)"}


def compare_plan(exp: ExperimentConfig, out: Path, resume: bool, only: list[str] | None,
                 overwrite: bool) -> list[str]:
    """The plan of ``dqsgd compare``: the checks of :func:`dqsgd.experiments.compare.prepare`, and
    what happens to each (method, seed) run."""
    from dqsgd.experiments.compare import finished, prepare
    from dqsgd.train.rundir import holds_run
    from dqsgd.train.runner import run_dir

    for e in exp.methods:
        _check_downlink(exp, e, processes=False)
    p = prepare(exp, out, resume, only, overwrite)
    t = exp.train
    lines = [f"dry run: compare {t.name} (config {exp.source or 'from the command line'})",
             _setting(exp, p.data, p.device), f"  output: {out}; {len(p.entries) * len(t.seeds)} runs:"]
    width = max(len(e.label) for e in p.entries)
    for seed in t.seeds:
        for e in p.entries:
            where = run_dir(out, e.label, seed)
            if not holds_run(where):
                what = "new"
            elif resume:
                what = "kept (finished)" if finished(where, t.steps, e.label, seed) else "continue from its checkpoint"
            else:
                what = "replace (--overwrite)"
            lines.append(f"    {e.label:<{width}}  seed {seed}  {where}  {what}")
    from dqsgd.experiments.report import FIGURES_MISSING, figures_available

    lines.append(f"  report: {out / 'report.md'}" + ("" if figures_available() else f"; {FIGURES_MISSING}"))
    return [*lines, DONE]
