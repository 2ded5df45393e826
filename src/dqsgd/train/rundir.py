"""Run directories: one writer at a time, no silent overwrite, and the resolved config of a run.

A run directory (``config.json``, ``metrics.jsonl``, ``summary.json``, checkpoints) belongs to one
run. :func:`open_run` holds ``RUN_DIR/.lock`` for as long as the run writes
(:func:`dqsgd.train.runfiles.dir_lock`: a second writer is refused at once, naming the holder's
pid), and refuses a directory that already holds a run unless the caller resumes it or asked to
overwrite it; a restarted run is written through :func:`staged` and replaces the old run's files
only when it finishes. Every file is written through :mod:`dqsgd.train.runfiles` (never through a
symbolic link), and read back through :mod:`dqsgd.train.reader`.

:func:`resolved` is the flat dict of every setting that changes a run's numbers: the train keys
except those in :data:`NOT_COMPARED`, the method's config, the effective lr/momentum, the seed and a
fingerprint of the data. Resume (:func:`check_same_run`), ``compare --resume``, ``report`` and the
rank agreement at start (:func:`dqsgd.train.runner.agree_across_ranks`) all compare this dict and name
the keys that differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from dqsgd.topology.registry import run_topology
from dqsgd.train.runfiles import RunDirError, atomic_write, dir_lock, read_json  # RunDirError, atomic_write: also public here

# Train keys that do not change the trained model or its measured bytes, so resume ignores them:
NOT_COMPARED = {
    "name": "names the output folder only",
    "data_root": "where the data is read from; its content is compared through the data fingerprint",
    "seeds": "a run has one seed, compared as `seed` (adding seeds to a comparison keeps the finished ones)",
    "eval_every": "when the test set is evaluated: evaluation never changes the model",
    "eval_samples": "how much of the test set is evaluated (same reason)",
    "checkpoint_every": "when checkpoints are written: resuming from one is exact",
    "threads": "CPU threads of one process: a speed setting",
}
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json")


STAGING = ".next"  # a restarted run is written here and replaces the old run's files only when it finishes


class RunFinished(RunDirError):
    """``--resume`` of a run that already finished: nothing to do (``summary`` is its summary.json)."""

    def __init__(self, out: Path, summary: dict[str, Any]):
        super().__init__(f"{out} already finished ({summary.get('steps')} steps, method {summary.get('method')}, "
                         f"seed {summary.get('seed')}); nothing to do (left untouched)")
        self.summary = summary


def holds_run(out: Path) -> bool:
    return any((out / name).exists() or (out / name).is_symlink() for name in RUN_FILES) or any(out.glob("checkpoint*.pt"))


@contextlib.contextmanager
def open_run(out: Path, resume: bool = False, overwrite: bool = False) -> Iterator[Path]:
    """Hold ``out`` exclusively while the block runs (:func:`dqsgd.train.runfiles.dir_lock`).

    Refused: ``out`` a file; ``resume`` of a missing directory; a directory that holds a run unless
    the caller resumes it or asked to overwrite it (the runner then restarts it through
    :func:`staged`: the old files stay until the new run finishes).
    """
    _check_dir(out, resume)
    out.mkdir(parents=True, exist_ok=True)
    f = dir_lock(out)
    try:
        _check_contents(out, resume, overwrite)
        yield out
    finally:
        f.close()  # closing the file drops the lock


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh ``out/.next`` for a restarted run (a leftover of an earlier restart is removed); when
    the block ends without error its files replace the run's in ``out`` (``summary.json`` last, so
    a run is never reported finished before its files are in place). On an error ``out`` keeps the
    old run as it was."""
    stage = out / STAGING
    if stage.is_symlink():
        raise RunDirError(f"{stage} is a symbolic link; remove it")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    yield stage
    (out / "summary.json").unlink(missing_ok=True)
    for p in out.glob("checkpoint*.pt"):
        if not (stage / p.name).exists():
            p.unlink()
    names = sorted((p.name for p in stage.iterdir()), key=lambda n: n == "summary.json")
    for name in names:
        target = out / name
        if target.is_symlink():
            raise RunDirError(f"{target} is a symbolic link; remove it (the new run is kept in {stage})")
        if target.is_dir():  # e.g. tensorboard/: replaced as a whole
            shutil.rmtree(target)
        os.replace(stage / name, target)
    stage.rmdir()


def check_run_dir(out: Path, resume: bool = False, overwrite: bool = False) -> str:
    """What :func:`open_run` would do with ``out`` ("new", "resume" or "replace"), or its refusal,
    without creating or locking anything (``--dry-run``)."""
    _check_dir(out, resume)
    return _check_contents(out, resume, overwrite)


def _check_dir(out: Path, resume: bool) -> None:
    if out.exists() and not out.is_dir():
        raise RunDirError(f"output directory {out} is a file, not a directory; choose another --out")
    if resume and not out.is_dir():
        raise RunDirError(f"--resume {out}: no such run directory")


def _check_contents(out: Path, resume: bool, overwrite: bool) -> str:
    if resume:
        return "resume"
    if not holds_run(out):
        return "new"
    if not overwrite:
        raise RunDirError(f"{out} already holds a run ({describe(out)}); continue it with --resume "
                          f"{out}, replace it with --overwrite, or choose another --out")
    return "replace"


def describe(out: Path) -> str:
    try:
        facts = read_json(out / "config.json")
        return f"method {facts.get('method')}, seed {facts.get('seed')}"
    except (OSError, ValueError, AttributeError):
        return "files " + ", ".join(sorted(p.name for p in out.iterdir() if p.name != ".lock"))


def clear_run(out: Path) -> None:
    """Remove the files of the run in ``out``; other files are left alone."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for p in out.glob("checkpoint*.pt"):
        p.unlink()


# --- the resolved config -------------------------------------------------------------------------
def update_hash(h: Any, obj: Any) -> None:
    """Feed ``obj`` into hashlib object ``h``: tensors by dtype, shape and bytes; dicts (keys in a fixed
    order), lists and tuples recursively; any other leaf by ``repr`` (exact for floats)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for k in sorted(obj, key=repr):
            update_hash(h, k)
            update_hash(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            update_hash(h, v)
    else:
        h.update(f"S{obj!r}\0".encode())


def data_fingerprint(data: Any) -> str:
    """sha256 of the data's name and of its train and test tensors (dtypes, shapes, bytes): equal data, equal hash."""
    h = hashlib.sha256()
    update_hash(h, [str(data.name), data.train.x, data.train.y, data.test.x, data.test.y])
    return h.hexdigest()[:32]


def resolved(train: dict[str, Any], method: str, method_config: dict[str, Any], seed: int,
             lr: float, momentum: float | None, data: str | None) -> dict[str, Any]:
    """The flat, JSON-normal dict of everything that decides a run's numbers (see the module docstring)."""
    out: dict[str, Any] = {f"train.{k}": v for k, v in train.items() if k not in NOT_COMPARED}
    out.update({f"method.{k}": v for k, v in method_config.items() if k != "description"})
    out.update(method=method, seed=seed, lr=lr, momentum=momentum, data=data)
    return _effective(json.loads(json.dumps(out)))


def _effective(res: dict[str, Any]) -> dict[str, Any]:
    """Topology "" (the transport's default) as the simulation's default: `compare` runs record "", `train` the
    name."""
    return {**res, "train.topology": run_topology("", processes=False)} if res.get("train.topology") == "" else res


def resolved_of_run(cfg: Any, entry: Any, seed: int, data_fp: str) -> dict[str, Any]:
    momentum = entry.optimizer_momentum(cfg)
    lr = entry.lr if entry.lr is not None else cfg.lr
    return resolved(dataclasses.asdict(cfg), entry.label, dataclasses.asdict(entry.config), seed, lr, momentum, data_fp)


def resolved_of_facts(facts: dict[str, Any]) -> dict[str, Any]:
    """The resolved config a ``config.json`` records (older files: rebuilt from their fields)."""
    if "resolved" in facts:
        return _effective(facts["resolved"])
    return resolved(facts.get("train_config", {}), facts.get("method"), facts.get("method_config", {}),
                    facts.get("seed"), facts.get("lr"), None, None)


def differing(a: dict[str, Any], b: dict[str, Any], ignore: tuple[str, ...] = ()) -> list[str]:
    """Keys whose values differ; a key one side lacks (an older ``config.json``) is not compared."""
    return sorted(k for k in set(a) & set(b) if k not in ignore and a[k] is not None and b[k] is not None and a[k] != b[k])


def explain(keys: list[str], ours: dict[str, Any], theirs: dict[str, Any], limit: int = 6) -> str:
    shown = [f"{k}: {theirs[k]!r} -> {ours[k]!r}" for k in keys[:limit]]
    return "; ".join(shown) + (f"; and {len(keys) - limit} more" if len(keys) > limit else "")


def check_same_run(out: Path, mine: dict[str, Any]) -> None:
    """Refuse to continue the run in ``out`` with a config that differs in any compared key."""
    try:
        facts = read_json(out / "config.json")
    except FileNotFoundError:
        return  # nothing recorded yet (a run stopped before its first write): the checkpoint meta still guards
    if not isinstance(facts, dict):
        raise RunDirError(f"{out}/config.json: not a JSON object; cannot check that the resumed run is the same")
    theirs = resolved_of_facts(facts)
    keys = differing(mine, theirs)
    if keys:
        raise RunDirError(f"{out} holds a run with another configuration ({explain(keys, mine, theirs)}); "
                          f"resume it unchanged, or start a new run with another --out (or --overwrite)")


def environment() -> dict[str, Any]:
    """Where a run ran (recorded, never compared): CPU model, versions, threads."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        import numba

        numba_version = numba.__version__
    except ImportError:
        numba_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "numba": numba_version, "python": platform.python_version(), "platform": platform.platform(),
            "gpu": gpu, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": source_commit()}


def source_commit() -> str:
    """The git commit of the dqsgd source that runs (with ``+changes`` if its tree differs), or "" when
    it is not a git checkout (an installed wheel)."""
    import subprocess

    here = Path(__file__).resolve().parents[1]  # the dqsgd package
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no", "--", "."],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + ("+changes" if dirty else "")


def experiment_of_run(out: Path) -> tuple[dict[str, Any], str, int]:
    """(raw config, method label, seed) of the run in ``out``, rebuilt from its ``config.json``, so
    ``dqsgd train --resume RUN_DIR`` needs neither --config nor the original --set options."""
    try:
        facts = read_json(out / "config.json")
    except FileNotFoundError:
        kind = "no such run directory" if not out.exists() else "no config.json (not a dqsgd run directory)"
        raise RunDirError(f"--resume {out}: {kind}") from None
    if not isinstance(facts, dict) or not all(isinstance(facts.get(k), t) for k, t in (
            ("method_config", dict), ("train_config", dict), ("method", str), ("seed", int))):
        raise RunDirError(f"{out}/config.json: not a dqsgd run's config.json (method, seed, method_config, "
                          f"train_config missing or of the wrong type)")
    mc, train = dict(facts["method_config"]), dict(facts["train_config"])
    mc.pop("lr", None)  # a config's methods.LABEL.lr is the optimizer's lr (method_lr below), never this field
    table = {"method": mc.pop("name"), **mc}
    lr, momentum = facts.get("method_lr"), facts.get("method_momentum")
    if "method_lr" not in facts and facts.get("lr") != train.get("lr"):  # older config.json: the effective lr
        lr = facts.get("lr")
    table.update({k: v for k, v in (("lr", lr), ("momentum", momentum)) if v is not None})
    train["seeds"] = list(train.get("seeds", [facts["seed"]]))
    return {"train": train, "methods": {facts["method"]: table}}, facts["method"], int(facts["seed"])
