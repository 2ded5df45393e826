"""Compare several methods on the same data and seeds (common random numbers)."""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dqsgd.data import load_dataset
from dqsgd.experiments.summary import SELECTION, selected_methods, write_tables
from dqsgd.train import reader
from dqsgd.train.config import ExperimentConfig, resolve_device
from dqsgd.train.progress import CompareProgress
from dqsgd.train.rundir import RunDirError, check_same_run, data_fingerprint, holds_run, resolved_of_run
from dqsgd.train.runfiles import atomic_write, dir_lock
from dqsgd.train.runner import run_dir, run_one


def load_data_for(exp: ExperimentConfig):
    t = exp.train
    return load_dataset(t.dataset, t.data_root or None, seed=0, max_len=t.max_len, subset=t.subset or None,
                        pad_to=t.pad_to or None)


def finished(where: Path, steps: int, label: str, seed: int, overwrite: bool = False) -> bool:
    """Whether ``where`` holds a completed run of (label, seed) with ``steps`` steps (its summary.json
    and all its metrics records; :func:`dqsgd.train.reader.finished`). A finished run whose metrics
    were cut is refused, or with ``overwrite`` re-run."""
    try:
        return reader.finished(where, steps, label, seed) is not None
    except reader.RunDataError:
        if overwrite:
            return False
        raise


@dataclass(frozen=True)
class Prepared:
    """A comparison checked before anything is written: its (method, seed) runs, device and data."""

    entries: list
    device: Any
    data: Any
    fingerprint: str


def prepare(exp: ExperimentConfig, out: Path, resume: bool = False, only: list[str] | None = None,
            overwrite: bool = False) -> Prepared:
    """Every check :func:`run_experiment` makes before its first run (``compare --dry-run`` stops here):
    the methods, ``--methods``, the device, the data, the output directory and, with
    ``resume``, that each kept run has this experiment's config."""
    entries = exp.select(only)
    device = resolve_device(exp.train.device)  # refused before any data is loaded or any run starts
    data = load_data_for(exp)
    fingerprint = data_fingerprint(data)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"output directory {out} is a file, not a directory; choose another --out")
    _check_existing(exp, entries, out, fingerprint, resume, overwrite)
    return Prepared(entries, device, data, fingerprint)


def run_experiment(exp: ExperimentConfig, out: Path, progress: bool = True, resume: bool = False,
                   only: list[str] | None = None, overwrite: bool = False) -> list[dict[str, Any]]:
    """Every (method, seed) of ``exp`` under ``out``/LABEL/seedK, then the tables, report and plots.

    ``resume``: finished runs are kept and unfinished ones continued, each only if its recorded
    config equals this experiment's (else refused, naming the keys). Without ``resume`` a run
    directory that holds a run is refused unless ``overwrite``.
    """
    if out.exists() and not out.is_dir():
        raise RunDirError(f"output directory {out} is a file, not a directory; choose another --out")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.closing(dir_lock(out)):  # one comparison at a time writes here (its runs, its tables)
        try:
            p = prepare(exp, out, resume, only, overwrite)
        except BaseException:
            if created:  # refused before anything was written: leave no directory behind
                shutil.rmtree(out, ignore_errors=True)
            raise
        if exp.source:
            atomic_write(out / "experiment.toml", Path(exp.source).read_text())
        earlier = selected_methods(out) or []
        chosen = {e.label for e in p.entries} | set(earlier)
        atomic_write(out / SELECTION, json.dumps({"methods": [e.label for e in exp.methods if e.label in chosen]}))
        return _run_all(exp, p, out, progress, resume, overwrite)


def _run_all(exp: ExperimentConfig, p: Prepared, out: Path, progress: bool, resume: bool,
             overwrite: bool) -> list[dict[str, Any]]:
    overall = CompareProgress(len(exp.train.seeds) * len(p.entries), enabled=progress)
    for seed in exp.train.seeds:
        for entry in p.entries:
            where = run_dir(out, entry.label, seed)
            again = resume and holds_run(where)
            if again and finished(where, exp.train.steps, entry.label, seed, overwrite):
                overall.kept(entry.label, seed)
                continue  # kept as it is: a resumed comparison only runs what is missing
            # resumed: an unfinished run continues from its checkpoint, or without one starts again
            # (its old files replaced only when the new run finishes)
            overall.finished(run_one(exp.train, entry, p.data, seed, where, resume=again, progress=progress,
                                     overwrite=overwrite or again, device=p.device))
    overall.close()
    rows = write_tables(out)
    from dqsgd.experiments.report import build_report

    build_report(out)
    return rows


def _check_existing(exp: ExperimentConfig, entries: list, out: Path, fingerprint: str, resume: bool,
                    overwrite: bool) -> None:
    """Before anything is written: refuse run directories that hold runs (unless ``resume`` or
    ``overwrite``), and with ``resume`` every kept run whose recorded config differs from ``exp``."""
    taken = [(e, s, run_dir(out, e.label, s)) for s in exp.train.seeds for e in entries if holds_run(run_dir(out, e.label, s))]
    if taken and not resume and not overwrite:
        names = ", ".join(str(w) for _, _, w in taken[:3]) + (f" and {len(taken) - 3} more" if len(taken) > 3 else "")
        raise RunDirError(f"{out} already holds runs ({names}); continue them with --resume, replace them with "
                          f"--overwrite, or choose another --out")
    for entry, seed, where in taken if resume else []:
        check_same_run(where, resolved_of_run(exp.train, entry, seed, fingerprint))
