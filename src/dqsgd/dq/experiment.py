"""Run an experiment (every method, the μ and φ sweeps) and write runs/<name>/.

Output: ``config.json`` (the resolved experiment), one ``<label>.jsonl`` per run (one line per
training-loss evaluation, then a ``summary`` line), ``results.json``, the PNG figures and
``report.md`` (:mod:`dqsgd.dq.report`). Bits are measured (``8·len(bytes)`` of every message).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from dqsgd.dq.config import Experiment, MethodRun
from dqsgd.dq.dist import run_dist
from dqsgd.dq.problem import Problem, lbfgs_minimum
from dqsgd.dq.result import RunResult
from dqsgd.dq.sim import run_sim
from dqsgd.train.metrics import JsonlWriter
from dqsgd.train.rundir import differing
from dqsgd.train.runfiles import RunDirError, atomic_write, dir_lock, read_json

__all__ = ["run_experiment", "resolve_target"]


def resolve_target(exp: Experiment, problem: Problem, log: Callable[[str], None]) -> tuple[float, float | None, str]:
    """(target, F* or None, how F* was obtained)."""
    s = exp.spec
    if s.target > 0:
        return s.target, None, "absolute target"
    if s.fstar > 0:
        return s.fstar + s.target_gap, s.fstar, f"F* from the config{': ' + s.fstar_note if s.fstar_note else ''}"
    t0 = time.perf_counter()
    fstar, _ = lbfgs_minimum(problem, max_iter=s.fstar_iters)
    how = f"F* by full-batch L-BFGS on this training set ({s.fstar_iters} iterations max, {time.perf_counter() - t0:.0f} s)"
    log(f"  {how}: F* = {fstar:.5f}")
    return fstar + s.target_gap, fstar, how


def _run_one(problem: Problem, exp: Experiment, mr: MethodRun) -> RunResult:
    if mr.cfg.transport == "torch":
        return run_dist(exp.problem, mr.cfg)
    return run_sim(problem, mr.cfg)


def _write_jsonl(path: Path, mr: MethodRun, res: RunResult) -> None:
    w = JsonlWriter(path)
    for e in res.evals:
        w.write({"event": "eval", "label": mr.label, **e.to_json()})
    w.write({"event": "summary", "label": mr.label, "group": mr.group, **res.summary()})
    w.close()


def run_experiment(exp: Experiment, out_root: Path, *, log: Callable[[str], None] = print,
                   overwrite: bool = False) -> dict:
    """Run everything in ``exp``; returns the results dict also written to results.json.

    ``out_root/<name>`` is held exclusively while it runs (a second writer is refused at once), and
    refused if it holds the results of an experiment with other settings, unless ``overwrite``.
    """
    out = out_root / exp.spec.name
    if out.exists() and not out.is_dir():
        raise RunDirError(f"output directory {out} is a file, not a directory; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.closing(dir_lock(out)):  # one writer at a time
        return _run_locked(exp, out, log, overwrite)


def _settings(exp: Experiment) -> dict:
    """What decides an experiment's results (``config.json`` minus the target, which is computed)."""
    runs = [{"label": r.label, "group": r.group, **asdict(r.cfg)} for r in exp.runs()]
    return json.loads(json.dumps({"experiment": asdict(exp.spec), "problem": asdict(exp.problem), "runs": runs}))


def check_same_experiment(out: Path, exp: Experiment) -> None:
    """Refuse ``out`` if it holds the results of an experiment with other settings (named)."""
    try:
        old = read_json(out / "config.json")  # a regular file (no FIFO, no link), bounded
    except FileNotFoundError:
        return
    if not isinstance(old, dict):
        raise RunDirError(f"{out}/config.json: not a JSON object; remove it or choose another --out")
    if "settings" not in old:  # written before settings were recorded: the results file tells
        if (out / "results.json").exists():
            raise RunDirError(f"{out} holds results of an earlier experiment; use --overwrite or another --out")
        return
    mine = _settings(exp)
    diff = differing(_flat(mine), _flat(old["settings"]))
    if diff:
        shown = "; ".join(f"{k}: {_flat(old['settings']).get(k)!r} -> {_flat(mine).get(k)!r}" for k in diff[:6])
        raise RunDirError(f"{out} holds the results of an experiment with other settings ({shown}); replace them "
                          f"with --overwrite, or choose another --out")


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if k == "runs" and isinstance(v, list):
            for r in v:
                out.update(_flat({x: y for x, y in r.items() if x != "label"}, f"methods.{r.get('label')}."))
        elif isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _run_locked(exp: Experiment, out: Path, log: Callable[[str], None], overwrite: bool) -> dict:
    if not overwrite:
        check_same_experiment(out, exp)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    problem = Problem(exp.problem)
    log(f"{exp.spec.name}: {exp.problem.dataset}/{exp.problem.model}, n = {problem.n}, d = {problem.d} ({problem.note})")
    target, fstar, how = resolve_target(exp, problem, log)
    runs = [dataclasses.replace(mr, cfg=dataclasses.replace(mr.cfg, target=target)) for mr in exp.runs()]
    atomic_write(out / "config.json", json.dumps({
        "source": exp.source, "experiment": asdict(exp.spec), "problem": asdict(exp.problem),
        "runs": [{"label": r.label, "group": r.group, **asdict(r.cfg)} for r in runs], "settings": _settings(exp)},
        indent=1))
    results: dict[str, dict] = {}
    cpu0 = time.process_time()
    for mr in runs:
        t1, c1 = time.perf_counter(), time.process_time()
        res = _run_one(problem, exp, mr)
        if mr.cfg.transport == "sim":  # torch: the work is in the spawned processes, not this one
            res.timers["cpu_s"] = time.process_time() - c1
        _write_jsonl(out / f"{mr.label}.jsonl", mr, res)
        summ = res.summary()
        results[mr.label] = {"group": mr.group, "evals": [e.to_json() for e in res.evals], **summ}
        got = summ["reached"]
        log(f"  {mr.label:<22} {time.perf_counter() - t1:6.1f} s ({res.timers.get('cpu_s', 0.0):.1f} s CPU)  updates {res.updates:5d}  final loss "
            f"{summ['final_loss']:.4f}  " + (f"target at {got['updates']} updates, {got['bits']:.3e} bits"
                                           if got else "target not reached"))
    doc = {"name": exp.spec.name, "source": exp.source, "target": target, "fstar": fstar, "fstar_how": how,
           "n": problem.n, "d": problem.d, "data_note": problem.note, "problem": asdict(exp.problem),
           "baseline": exp.spec.baseline, "wall_s": time.perf_counter() - t0,
           "cpu_s": time.process_time() - cpu0, "runs": results}
    atomic_write(out / "results.json", json.dumps(doc, indent=1, default=str))
    from dqsgd.dq.report import write_report  # matplotlib only when there is something to draw

    write_report(doc, out)
    log(f"{exp.spec.name}: done in {time.perf_counter() - t0:.0f} s -> {out / 'report.md'}")
    return doc
