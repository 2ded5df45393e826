"""The report's "Reproduce" section: the shell commands that give these runs again.

``experiment.toml``'s own command, then for each group of methods run with the same seed list the
``dqsgd compare`` command whose ``--set``/``--methods`` arguments turn the config file into exactly
these runs (values written so that ``--set`` reads them back), and the ``dqsgd report`` rebuild.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

from dqsgd.experiments.plots import Run, methods_of
from dqsgd.train.reader import read_experiment
from dqsgd.train.runfiles import read_text

__all__ = ["reproduce_commands"]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        try:
            tomllib.loads(f"v = {v}")
        except tomllib.TOMLDecodeError:
            if re.fullmatch(r"[A-Za-z0-9_.\-/]+", v):
                return v  # a bare word is read as a string by --set
        return json.dumps(v)
    return repr(v)


def _plain(x: Any) -> Any:
    return json.loads(json.dumps(x))  # tuples -> lists, as in config.json


def _overrides(root: Path, runs: list[Run]) -> tuple[list[str], list[str]]:
    """(--set/--methods arguments that turn experiment.toml into these runs, caveats)."""
    from dqsgd.train.config import build_experiment

    try:
        exp = build_experiment(read_experiment(root) or {})
    except Exception as e:  # noqa: BLE001 - any failure only means we cannot derive the overrides
        return [], [f"could not compare the runs with experiment.toml ({e})"]
    args, caveats = [], []
    labels = methods_of(runs)
    entries = {e.label: e for e in exp.methods}
    # a method's own [train] keys (its table's local_steps, downlink_bits, ...) are that method's, not [train]'s
    owned = {m: dict(_plain(dict(entries[m].train))) for m in labels if m in entries}
    file_train, ran_train = _plain(dataclasses.asdict(exp.train)), {}
    for r in runs:
        for k, v in r.facts["train_config"].items():
            if k not in owned.get(r.method, {}):
                ran_train.setdefault(k, v)
    # the seeds these runs have, whatever list each ran in
    ran_train = {**ran_train, "seeds": sorted({r.seed for r in runs})}
    args += [f"train.{k}={_toml_value(v)}" for k, v in ran_train.items() if file_train.get(k) != v]
    for m in labels:
        if m not in entries:
            caveats.append(f"method {m!r} is not in experiment.toml")
            continue
        facts = next(r.facts for r in runs if r.method == m)
        want = _plain(dataclasses.asdict(entries[m].config))
        args += [f"methods.{m}.{k}={_toml_value(v)}" for k, v in facts["method_config"].items() if want.get(k) != v]
        args += [f"methods.{m}.{k}={_toml_value(facts['train_config'][k])}" for k, v in owned[m].items()
                 if k in facts["train_config"] and facts["train_config"][k] != v]
        lr = entries[m].lr if entries[m].lr is not None else ran_train.get("lr", facts["train_config"]["lr"])
        if facts.get("lr") is not None and not math.isclose(facts["lr"], lr):
            args.append(f"methods.{m}.lr={_toml_value(facts['lr'])}")
    sets = [a for x in args for a in ("--set", shlex.quote(x))]
    if [e.label for e in exp.methods] != labels and all(m in entries for m in labels):
        sets = ["--methods", ",".join(labels)] + sets
    return sets, caveats


def reproduce_commands(root: Path, runs: list[Run]) -> list[str]:
    """Shell lines: the config's own command, the exact command for these runs, and the report rebuild."""
    cfg = root / "experiment.toml"
    rebuild = f"dqsgd report {shlex.quote(str(root))}   # rebuild tables, figures and this report from the JSONL files"
    if not cfg.is_file():
        return ["# no experiment.toml here: these runs were not written by `dqsgd compare`", rebuild]
    first = next((ln for ln in read_text(cfg).splitlines() if ln.startswith("#")), "")  # a regular file, bounded
    given = first.lstrip("# ").split("  ")[0].strip()
    name = re.search(r"--config\s+(\S+)", given)
    config = name.group(1) if name else shlex.quote(str(cfg))
    groups: dict[tuple[int, ...], list[Run]] = {}  # methods run with different seed lists: one command each
    for m in methods_of(runs):
        mine = [r for r in runs if r.method == m]
        groups.setdefault(tuple(sorted(r.seed for r in mine)), []).extend(mine)
    lines = [f"{given}   # the config file's own command" if given else "# experiment.toml names no command"]
    for i, group in enumerate(groups.values()):
        sets, caveats = _overrides(root, group)
        if len(groups) > 1 and "--methods" not in sets:
            sets = ["--methods", ",".join(methods_of(group))] + sets
        exact = " ".join(["dqsgd compare --config", config, *sets, "--out", shlex.quote(str(root))]
                         + (["--resume"] if i else []))
        lines.append(f"{exact}   # exactly these runs" + (f" ({i + 1} of {len(groups)}: seed lists differ)"
                                                            if len(groups) > 1 else ""))
        lines += [f"# caveat: {c}" for c in caveats]
    return lines + [rebuild]
