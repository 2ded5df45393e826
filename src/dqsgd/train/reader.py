"""The one reader of run directories: ``config.json``, ``metrics.jsonl`` and ``summary.json``,
every number checked before a table, a figure or ``compare --resume`` uses it.

A record's fields are checked against :data:`FIELDS`: present where required, of the right type,
finite and in range. A value that is not — a missing ``up_bytes``, ``Infinity``, ``1e308`` bytes,
``test_acc: Infinity`` — stops the reader with :class:`RunDataError` naming the file, the line and
the field (``dqsgd`` prints it on one line, exit code 2). A line that is not a JSON record at all
(the torn last line of a crash) is skipped and named on stderr, as :func:`dqsgd.train.metrics.read_jsonl`
does. A damaged ``config.json`` is refused naming the file.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Iterator

from dqsgd.core.config_file import parse_toml
from dqsgd.method.config import FIELDS as METHOD_FIELDS, method_config
from dqsgd.train.config import SCHEMA, ConfigError, TrainConfig
from dqsgd.train.metrics import read_jsonl
from dqsgd.train.runfiles import RunDataError, inside, lock_holder, read_json, read_text

__all__ = ["FIELDS", "RunDataError", "finished", "iter_records", "read_experiment", "read_facts", "read_records",
           "read_run", "run_dirs"]

_BYTES = 1 << 53      # byte counts are exact integers below 2^53 (8 PiB)
_SECONDS = 1e9
_NUMEL = _BYTES // 4  # a model whose one fp32 message is a byte count below 2^53

# field: (required, kind, low, high); kind "int" (not bool), "num" (finite), "loss" (finite, null
# or the writer's "inf"/"-inf" for a diverged run), "acc" (null or in range), "bool".
FIELDS: dict[str, tuple[bool, str, float, float]] = {
    "step": (True, "int", 0, _BYTES),
    "up_bytes": (True, "int", 0, _BYTES),
    "down_bytes": (True, "int", 0, _BYTES),
    "side_bytes": (False, "int", 0, _BYTES),
    "rank_total_bytes": (False, "int", 0, _BYTES),
    "coded_up_bytes": (False, "int", 0, _BYTES),
    "bits": (True, "num", 0, 64),
    "loss": (False, "loss", -math.inf, math.inf),
    "test_acc": (False, "acc", 0, 1),
    "test_loss": (False, "loss", -math.inf, math.inf),
    "compute_s": (True, "num", 0, _SECONDS),
    "encode_s": (True, "num", 0, _SECONDS),
    "decode_s": (True, "num", 0, _SECONDS),
    "skipped": (False, "bool", 0, 1),
    "sim_time_s": (False, "num", 0, 1e15),  # the simulated clock (dqsgd.train.slownodes)
}
_FACTS: dict[str, tuple[type, ...]] = {"method": (str,), "seed": (int,), "workers": (int,), "numel": (int,),
                                       "dataset": (str,), "train_config": (dict,), "method_config": (dict,)}


def _why(kind: str, low: float, high: float, v: Any) -> str | None:
    if kind == "bool":
        return None if isinstance(v, bool) else "must be true or false"
    if kind in ("loss", "acc") and (v is None or (kind == "loss" and v in ("inf", "-inf"))):
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "must be a number"
    if kind == "int" and not isinstance(v, int):
        return "must be an integer"
    if not math.isfinite(v):
        return "must be finite"
    if not low <= v <= high:
        return f"must be in [{low:g}, {high:g}]"
    return None


def check_record(rec: dict[str, Any], where: str, steps: int | None = None) -> dict[str, Any]:
    """``rec`` if every field of :data:`FIELDS` in it is valid (and the required ones present), and its
    ``step`` below the run's ``steps`` (``train.steps`` of its ``config.json``), when given."""
    for name, (required, kind, low, high) in FIELDS.items():
        if name not in rec:
            if required and not (rec.get("skipped") and name == "bits"):
                raise RunDataError(f"{where}: field {name!r} is missing")
            continue
        why = _why(kind, low, high if name != "step" or steps is None else steps - 1, rec[name])
        if why is not None:
            raise RunDataError(f"{where}: field {name!r} {why}, got {rec[name]!r}"
                               + (f" (train.steps = {steps})" if name == "step" and steps is not None else ""))
    return rec


def iter_records(path: Path, steps: int | None = None, max_line: int | None = None) -> Iterator[dict[str, Any]]:
    """Every record of a ``metrics.jsonl``, each checked (:func:`check_record`), one at a time: the
    file is streamed line by line (each line at most ``max_line`` bytes), never held whole."""
    for n, rec in read_jsonl(path, numbered=True, max_line=max_line):
        yield check_record(rec, f"{path}:{n}", steps)


def read_records(path: Path, steps: int | None = None) -> list[dict[str, Any]]:
    """:func:`iter_records` as a list (for a run of known, small size)."""
    return list(iter_records(path, steps))


def read_facts(run: Path) -> dict[str, Any]:
    """A run's ``config.json``, checked to be a JSON object with the fields the tables use, and its
    numbers within the configuration's own ranges: ``train_config`` must pass :class:`TrainConfig`'s
    checks (``workers`` in 1..4096, ``steps`` in 1..10^9, ...), ``workers`` must be its
    ``train_config.workers``, and ``numel`` a parameter count whose fp32 message is below 2^53 bytes."""
    path = run / "config.json"
    facts = read_json(path)  # a regular file (no FIFO, no link), bounded in bytes; damage names the file
    if not isinstance(facts, dict):
        raise RunDataError(f"{path}: not a JSON object")
    for name, types in _FACTS.items():
        v = facts.get(name)
        if not isinstance(v, types) or isinstance(v, bool):
            raise RunDataError(f"{path}: field {name!r} must be {types[0].__name__}, got {v!r}")
    train = checked_train(facts["train_config"], str(path))
    checked_method(facts["method_config"], str(path))
    if not (facts.get("budget_bits") is None or (isinstance(facts["budget_bits"], (int, float))
                                                 and not isinstance(facts["budget_bits"], bool)
                                                 and 0 <= facts["budget_bits"] < math.inf)):
        raise RunDataError(f"{path}: field 'budget_bits' must be null or a finite number >= 0, got {facts['budget_bits']!r}")
    if facts["workers"] != train.workers:
        raise RunDataError(f"{path}: field 'workers' is {facts['workers']!r}, but train_config.workers is {train.workers}")
    if not 1 <= facts["numel"] <= _NUMEL or facts["seed"] < 0:
        raise RunDataError(f"{path}: numel must be in [1, 2^51] and seed >= 0, got numel {facts['numel']!r}, "
                           f"seed {facts['seed']!r}")
    return facts


def checked_train(train: dict[str, Any], where: str) -> TrainConfig:
    """A recorded ``train_config`` as the :class:`TrainConfig` it says, through the config's own type and
    range checks (keys an older dqsgd wrote and this one lacks are left out)."""
    known = {k: v for k, v in train.items() if k in TrainConfig.__dataclass_fields__}
    try:
        return TrainConfig(**SCHEMA.fields(TrainConfig, "train_config", known))
    except ConfigError as e:
        raise RunDataError(f"{where}: {e}") from None


def checked_method(mc: dict[str, Any], where: str) -> None:
    """A recorded ``method_config`` through the method's own checks (:func:`dqsgd.method.config.method_config`)."""
    try:
        method_config(mc.get("name"), **{k: v for k, v in mc.items() if k in METHOD_FIELDS and k != "name"})
    except (TypeError, ValueError) as e:
        raise RunDataError(f"{where}: method_config: {e}") from None


def read_run(run: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(config.json, the checked records of metrics.jsonl) of one run directory."""
    facts = read_facts(run)
    return facts, read_records(run / "metrics.jsonl", facts["train_config"]["steps"])


def run_records(run: Path, facts: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The checked records of ``run``'s metrics.jsonl, streamed, steps within its ``train.steps``."""
    return iter_records(run / "metrics.jsonl", facts["train_config"]["steps"])


def run_dirs(root: Path) -> list[Path]:
    """The run directories under ``root`` (a ``metrics.jsonl`` with a ``config.json``; none inside a
    hidden directory such as a restart's ``.next``). Refused while another process writes one of
    them or ``root`` itself: a table never includes a run in progress."""
    found = sorted(inside(root, p.parent) for p in root.rglob("metrics.jsonl")  # (rglob enters no linked directory)
                   if (p.parent / "config.json").exists()
                   and not any(part.startswith(".") for part in p.parent.relative_to(root).parts))
    for d in [root, *found]:
        holder = lock_holder(d)
        if holder is not None and holder != str(os.getpid()):
            raise RunDataError(f"{d} is being written by another dqsgd process (pid {holder}); "
                               f"wait for it to finish, then report")
    return found


def finished(where: Path, steps: int, label: str, seed: int) -> dict[str, Any] | None:
    """The ``summary.json`` of a completed run of (label, seed) with ``steps`` steps, else None.

    Raises:
      RunDataError: the summary says the run finished but ``metrics.jsonl`` does not hold its
        ``steps`` records (cut or damaged): the run must be re-run, not reported.
    """
    try:
        s = read_json(where / "summary.json")
    except FileNotFoundError:
        return None
    if not isinstance(s, dict) or (s.get("steps"), s.get("method"), s.get("seed")) != (steps, label, seed):
        return None
    try:
        held = distinct_steps(where / "metrics.jsonl", steps)
    except FileNotFoundError:
        held = 0
    if held != steps:
        raise RunDataError(f"{where}: summary.json says the run finished {steps} steps, but metrics.jsonl holds "
                           f"{held} step records (cut or damaged); re-run this run with --overwrite")
    return s


def distinct_steps(path: Path, steps: int) -> int:
    """How many distinct steps in [0, steps) the records of ``path`` hold (one bit per step: the
    memory is bounded by the configuration's ``steps``, not by the file)."""
    seen = bytearray((steps + 7) // 8)
    count = 0
    for rec in iter_records(path, steps):
        i = rec["step"]
        if not seen[i >> 3] >> (i & 7) & 1:
            seen[i >> 3] |= 1 << (i & 7)
            count += 1
    return count


def read_experiment(root: Path) -> dict[str, Any] | None:
    """``root/experiment.toml`` as a dict (None when there is none), read like every run file (a
    regular file, bounded) and parsed with the config loader's checks (nesting too deep is refused
    naming the file, as for ``--config``)."""
    path = root / "experiment.toml"
    try:
        text = read_text(path)
    except FileNotFoundError:
        return None
    return parse_toml(text, str(path), RunDataError)
